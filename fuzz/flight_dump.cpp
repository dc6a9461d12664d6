// Flight-recorder dumps (comm/flight_dump.h): up to 8 ranks' dumps, separated
// by NUL bytes, parsed, then diagnosed and reported as `debug hang` does.
#include <vector>

#include "fuzz_support.h"
#include "meshtrain/comm/flight_dump.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace meshtrain;
  const std::string_view text = fuzz::as_text(data, size);
  fuzz::run_reader([&] {
    std::vector<RankFlight> dumps;
    size_t begin = 0;
    while (begin <= text.size() && dumps.size() < 8) {
      size_t end = text.find('\0', begin);
      if (end == std::string_view::npos) end = text.size();
      dumps.push_back(parse_flight_dump(std::string(text.substr(begin, end - begin)),
                                        flight_dump_name(static_cast<int>(dumps.size()))));
      begin = end + 1;
    }
    format_hang_report(diagnose_hang(dumps), "flight/job");
  });
  return 0;
}
