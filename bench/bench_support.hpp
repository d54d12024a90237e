// SPDX-License-Identifier: Apache-2.0
// Shared by the benchmarks: a reporter that prints, after the usual table, ratios between runs
// measured in the same process (e.g. attention bandwidth / memory-read bandwidth).
#pragma once

#include <benchmark/benchmark.h>

#include <cstdio>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace kvcache::bench {

/// Console reporter that also records every run's counters by run name, and afterwards prints
/// ratio lines computed by a callback from those figures.
class RatioReporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const Run& run : runs) {
      if (run.run_type != Run::RT_Iteration || failed(run)) continue;
      auto& entry = figures_[run.benchmark_name()];
      entry["real_time_ns"] = run.GetAdjustedRealTime();
      for (const auto& [name, counter] : run.counters) entry[name] = counter.value;
    }
  }

  /// counters of run `name` ("" map if the run did not happen).
  [[nodiscard]] const std::map<std::string, double>& figures(const std::string& name) const {
    static const std::map<std::string, double> none;
    const auto it = figures_.find(name);
    return it == figures_.end() ? none : it->second;
  }
  [[nodiscard]] double figure(const std::string& name, const std::string& counter) const {
    const auto& f = figures(name);
    const auto it = f.find(counter);
    return it == f.end() ? 0.0 : it->second;
  }
  [[nodiscard]] const std::map<std::string, std::map<std::string, double>>& all() const {
    return figures_;
  }

 private:
  // Google Benchmark 1.7 (Debian) names it error_occurred, 1.8+ skipped.
  template <class R>
  static bool failed(const R& run) {
    if constexpr (requires { run.skipped; }) {
      return static_cast<bool>(run.skipped);
    } else {
      return run.error_occurred;
    }
  }

  std::map<std::string, std::map<std::string, double>> figures_;
};

/// Runs the registered benchmarks with a RatioReporter, then calls `summary` with it.
inline int run_with_summary(int argc, char** argv,
                            const std::function<void(const RatioReporter&)>& summary) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  RatioReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  std::printf("\n");
  summary(reporter);
  benchmark::Shutdown();
  return 0;
}

}  // namespace kvcache::bench
