// What `meshtrain plan` prints: the ranked table with the memory breakdown and
// the binding bottleneck, one line per rejected family, --json for tools and
// --explain with every formula's numbers substituted.
#pragma once

#include <string>

#include "meshtrain/plan/search.h"

namespace meshtrain::plan {

struct PlanInputs {
  std::string model_name;
  PlanContext ctx;
  Cluster cluster;  // gpus = the first count searched
  Job job;
  SearchOptions options;
  std::string batch_note;  // how --global-batch-tokens was read, if it needed saying
};

std::string format_table(const PlanInputs& in, const SearchResult& result);
std::string format_json(const PlanInputs& in, const SearchResult& result);
// The arithmetic of one estimate, step by step.
std::string format_explain(const PlanInputs& in, const Estimate& est);

// "1.23B", "355M", "16.8K"
std::string human_count(double n);
// "16,777,216"
std::string grouped(double n);
// "$12.30M"
std::string money(double usd);
// "2.50 GiB"
std::string gib(double bytes);

}  // namespace meshtrain::plan
