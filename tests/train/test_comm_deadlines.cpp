// Which calls get which deadline: the long one outside steps and in the first
// step a process runs, comm.timeout_s inside later steps.
#include <gtest/gtest.h>

#include "meshtrain/train/comm_deadlines.h"

namespace meshtrain {
namespace {

TEST(CommDeadlines, LongOutsideStepsAndInTheFirstShortInside) {
  FlightRecorder recorder;
  CommSettings settings;
  settings.timeout_s = 5;
  settings.long_timeout_s = 600;
  CommDeadlines hook(recorder, settings);
  EXPECT_EQ(recorder.timeout(), 600);  // start-up
  hook.before_step(41);                // the first step of a resumed run
  EXPECT_EQ(recorder.timeout(), 600);
  hook.on_step(StepRecord{});
  EXPECT_EQ(recorder.timeout(), 600);  // evaluation, checkpoint
  hook.before_step(42);
  EXPECT_EQ(recorder.timeout(), 5);
  hook.on_step(StepRecord{});
  EXPECT_EQ(recorder.timeout(), 600);
}

}  // namespace
}  // namespace meshtrain
