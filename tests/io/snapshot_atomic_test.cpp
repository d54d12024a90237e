// SPDX-License-Identifier: Apache-2.0
// Atomic saves: a child process saving snapshots in a loop is SIGKILLed at random moments, many
// times; after every kill the target is byte-identical to one of the complete snapshots and
// loads. Temporaries of killed savers are cleaned up; a save failing mid-write (file size limit)
// leaves the previous snapshot and no temporary.
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <iostream>
#include <thread>
#include <vector>

#include "kvcache/io/snapshot.hpp"
#include "kvcache/kvcache.hpp"
#include "support/catch.hpp"
#include "support/snapshot_helpers.hpp"

using namespace kvcache;
using kvcache::test::TempDir;

namespace {

const ModelId kModel("atomic-test-model");
const StaticCacheConfig kConfig{
    .num_layers = 4, .num_kv_heads = 8, .head_dim = 128, .max_batch = 1, .max_seq_len = 2048};

std::vector<std::byte> read_file(const std::filesystem::path& path) {
  std::vector<std::byte> out(std::filesystem::file_size(path));
  std::ifstream(path, std::ios::binary)
      .read(reinterpret_cast<char*>(out.data()), static_cast<std::streamsize>(out.size()));
  return out;
}

std::size_t count_temps(const std::filesystem::path& target) {
  std::size_t n = 0;
  const std::string prefix = target.filename().string() + ".tmp.";
  for (const auto& e : std::filesystem::directory_iterator(target.parent_path())) {
    if (e.path().filename().string().rfind(prefix, 0) == 0) ++n;
  }
  return n;
}

}  // namespace

TEST_CASE("a saver killed at random moments always leaves a complete, loadable snapshot") {
  auto rng = kvcache::test::make_rng("atomic-kill");
  TempDir dir("atomic-kill");
  const auto target = dir / "prompt.kvs";
  // Three distinct cache states (~33 MB snapshots, so that a save takes a while).
  std::vector<StaticCache<half>> caches;
  std::vector<std::vector<std::byte>> expected;
  for (std::size_t v = 0; v < 3; ++v) {
    caches.emplace_back(kConfig);
    kvcache::test::append_random(caches.back(), rng, 0, 2048 - 100 * v, 512);
    expected.push_back(snapshot_to_bytes(caches.back(), kModel));
  }
  const auto t0 = std::chrono::steady_clock::now();
  save_snapshot(target, caches[0], kModel);
  const double save_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  REQUIRE(read_file(target) == expected[0]);

  const int kills = 30;
  std::size_t mid_save = 0;
  std::vector<std::size_t> seen(3, 0);
  std::size_t last = 0;
  StaticCache<half> loaded(kConfig);
  for (int k = 0; k < kills; ++k) {
    const pid_t child = ::fork();
    REQUIRE(child >= 0);
    if (child == 0) {  // saves forever, cycling through the three states
      try {
        for (std::size_t i = 1;; ++i) save_snapshot(target, caches[i % 3], kModel);
      } catch (...) {
        ::_exit(3);
      }
    }
    const double wait_s = std::uniform_real_distribution<double>(0.0, 4.0 * save_s)(rng);
    std::this_thread::sleep_for(std::chrono::duration<double>(wait_s));
    REQUIRE(::kill(child, SIGKILL) == 0);
    int status = 0;
    REQUIRE(::waitpid(child, &status, 0) == child);
    INFO("kill " << k << " after " << wait_s << " s; child status " << status);
    REQUIRE(WIFSIGNALED(status));  // it was still saving, not failed
    REQUIRE(WTERMSIG(status) == SIGKILL);
    if (count_temps(target) > 0) ++mid_save;
    const auto bytes = read_file(target);
    std::size_t which = 3;
    for (std::size_t v = 0; v < 3; ++v) {
      if (bytes == expected[v]) which = v;
    }
    REQUIRE(which < 3);  // byte for byte one complete snapshot
    ++seen[which];
    last = which;
    load_snapshot(target, loaded, kModel);
    REQUIRE(loaded.seq_length(0) == caches[which].seq_length(0));
  }
  kvcache::test::require_same_contents(loaded, caches[last]);
  std::cerr << "[atomic] save takes " << save_s << " s; " << kills << " kills, " << mid_save
            << " of them mid-save (temporary left behind); target held state 0/1/2 " << seen[0]
            << "/" << seen[1] << "/" << seen[2] << " times\n";
  REQUIRE(mid_save > 0);  // the kills did interrupt writes
  // the next save removes the dead savers' temporaries
  save_snapshot(target, caches[2], kModel);
  REQUIRE(count_temps(target) == 0);
  REQUIRE(read_file(target) == expected[2]);
}

TEST_CASE("a save that fails mid-write keeps the previous snapshot and removes its temporary") {
  auto rng = kvcache::test::make_rng("atomic-fail");
  TempDir dir("atomic-fail");
  const auto target = dir / "prompt.kvs";
  StaticCache<half> small(
      {.num_layers = 1, .num_kv_heads = 1, .head_dim = 8, .max_batch = 1, .max_seq_len = 16});
  kvcache::test::append_random(small, rng, 0, 10, 10);
  save_snapshot(target, small, kModel);
  const auto before = read_file(target);
  StaticCache<half> big(kConfig);
  kvcache::test::append_random(big, rng, 0, 2048, 1024);
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {  // a 1 MiB file size limit: writes fail with EFBIG
    ::signal(SIGXFSZ, SIG_IGN);
    const rlimit limit{1 << 20, 1 << 20};
    ::setrlimit(RLIMIT_FSIZE, &limit);
    try {
      save_snapshot(target, big, kModel);
    } catch (const io_error& e) {
      ::_exit(e.code() == EFBIG ? 0 : 2);
    } catch (...) {
      ::_exit(3);
    }
    ::_exit(4);  // the save should not have succeeded
  }
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  REQUIRE(WIFEXITED(status));
  REQUIRE(WEXITSTATUS(status) == 0);
  REQUIRE(read_file(target) == before);
  REQUIRE(count_temps(target) == 0);
  // temporaries of live processes (this one) are never removed
  const auto live = dir / ("prompt.kvs.tmp." + std::to_string(::getpid()) + ".999");
  std::ofstream(live) << "in progress";
  const auto dead = dir / "prompt.kvs.tmp.999999999.1";  // above any pid_max
  std::ofstream(dead) << "left by a killed saver";
  REQUIRE(remove_stale_temp_files(target) == 1);
  REQUIRE(std::filesystem::exists(live));
  REQUIRE(!std::filesystem::exists(dead));
}
