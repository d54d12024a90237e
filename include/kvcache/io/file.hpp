// SPDX-License-Identifier: Apache-2.0
// POSIX file plumbing for snapshots: RAII descriptors and read-only mappings, whole-file reads, and
// AtomicFileWriter, which replaces a file by write-temp / fsync / rename / fsync-dir. Linux's read
// advice (posix_fadvise, MAP_POPULATE) is used where the platform has it; elsewhere (macOS) mapped
// pages fault in on first touch, with MADV_SEQUENTIAL's readahead.
#pragma once

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvcache/io/error.hpp"

namespace kvcache {
namespace detail {

/// Owns a file descriptor; closes it on destruction. Move-only.
class UniqueFd {
 public:
  UniqueFd() noexcept = default;
  explicit UniqueFd(int fd) noexcept : fd_(fd) {}
  UniqueFd(UniqueFd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept {
    if (this != &other) {
      reset();
      fd_ = std::exchange(other.fd_, -1);
    }
    return *this;
  }
  ~UniqueFd() { reset(); }

  [[nodiscard]] int get() const noexcept { return fd_; }
  [[nodiscard]] explicit operator bool() const noexcept { return fd_ >= 0; }
  void reset() noexcept {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }
  /// Closes the descriptor, reporting the error close() returns (a delayed write error).
  /// @throws io_error naming `path`.
  void close_checked(const std::filesystem::path& path) {
    const int fd = std::exchange(fd_, -1);
    if (fd >= 0 && ::close(fd) != 0 && errno != EINTR) {
      throw io_error(detail::message("close '", path.string(), "'"), errno);
    }
  }

 private:
  int fd_ = -1;
};

/// Opens `path` read-only. @throws io_error (ENOENT for a missing file, ...).
[[nodiscard]] inline UniqueFd open_for_reading(const std::filesystem::path& path) {
  int fd;
  do {
    fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) throw io_error(detail::message("open '", path.string(), "' for reading"), errno);
  return UniqueFd(fd);
}

/// Size of the open file in bytes. @throws io_error (fstat), format_error for a non-regular file.
[[nodiscard]] inline std::uint64_t regular_file_size(int fd, const std::filesystem::path& path) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) throw io_error(detail::message("fstat '", path.string(), "'"), errno);
  if (!S_ISREG(st.st_mode)) {
    throw format_error(detail::message("'", path.string(), "' is not a regular file"));
  }
  return static_cast<std::uint64_t>(st.st_size);
}

/// Reads exactly n bytes at `offset` (retrying short reads and EINTR).
/// @throws io_error; snapshot_truncated_error if the file ends first.
inline void read_exact_at(int fd, void* out, std::size_t n, std::uint64_t offset,
                          const std::filesystem::path& path) {
  auto* p = static_cast<std::byte*>(out);
  while (n > 0) {
    const std::size_t chunk = std::min<std::size_t>(n, std::size_t{1} << 30);
    const ssize_t got = ::pread(fd, p, chunk, static_cast<off_t>(offset));
    if (got < 0) {
      if (errno == EINTR) continue;
      throw io_error(detail::message("read '", path.string(), "' at offset ", offset), errno);
    }
    if (got == 0) {
      throw snapshot_truncated_error(
          detail::message("'", path.string(), "' ended at offset ", offset, " while reading"),
          offset);
    }
    p += got;
    n -= static_cast<std::size_t>(got);
    offset += static_cast<std::uint64_t>(got);
  }
}

/// Writes all n bytes (retrying short writes and EINTR). @throws io_error naming `path`.
inline void write_all(int fd, const void* data, std::size_t n, const std::filesystem::path& path) {
  const auto* p = static_cast<const std::byte*>(data);
  while (n > 0) {
    const std::size_t chunk = std::min<std::size_t>(n, std::size_t{1} << 30);
    const ssize_t put = ::write(fd, p, chunk);
    if (put < 0) {
      if (errno == EINTR) continue;
      throw io_error(detail::message("write '", path.string(), "'"), errno);
    }
    p += put;
    n -= static_cast<std::size_t>(put);
  }
}

/// Writes all n bytes at `offset`. @throws io_error naming `path`.
inline void pwrite_all(int fd, const void* data, std::size_t n, std::uint64_t offset,
                       const std::filesystem::path& path) {
  const auto* p = static_cast<const std::byte*>(data);
  while (n > 0) {
    const ssize_t put = ::pwrite(fd, p, n, static_cast<off_t>(offset));
    if (put < 0) {
      if (errno == EINTR) continue;
      throw io_error(detail::message("write '", path.string(), "' at offset ", offset), errno);
    }
    p += put;
    n -= static_cast<std::size_t>(put);
    offset += static_cast<std::uint64_t>(put);
  }
}

/// fsync, retried on EINTR. @throws io_error naming `path`.
inline void fsync_checked(int fd, const std::filesystem::path& path) {
  while (::fsync(fd) != 0) {
    if (errno != EINTR) throw io_error(detail::message("fsync '", path.string(), "'"), errno);
  }
}

/// A read-only private mapping of a whole file; unmapped on destruction. Move-only.
class MappedFile {
 public:
  MappedFile() noexcept = default;
  /// Maps `size` bytes of `fd` (size > 0), prefaulting the page tables (MAP_POPULATE) so that
  /// the first pass over the bytes takes no page faults; pages not in the page cache are first
  /// requested as one large readahead (POSIX_FADV_WILLNEED). Where the platform lacks either
  /// (macOS), that step is skipped. @throws io_error (mmap).
  MappedFile(int fd, std::size_t size, const std::filesystem::path& path) : size_(size) {
#if defined(POSIX_FADV_WILLNEED)
    ::posix_fadvise(fd, 0, static_cast<off_t>(size), POSIX_FADV_WILLNEED);
#endif
#if defined(MAP_POPULATE)
    constexpr int populate = MAP_POPULATE;
#else
    constexpr int populate = 0;
#endif
    void* p = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE | populate, fd, 0);
    if (p == MAP_FAILED) throw io_error(detail::message("mmap '", path.string(), "'"), errno);
    data_ = static_cast<const std::byte*>(p);
    ::madvise(p, size, MADV_SEQUENTIAL);  // advisory only: its failure changes nothing
  }
  MappedFile(MappedFile&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}
  MappedFile& operator=(MappedFile&& other) noexcept {
    if (this != &other) {
      unmap();
      data_ = std::exchange(other.data_, nullptr);
      size_ = std::exchange(other.size_, 0);
    }
    return *this;
  }
  ~MappedFile() { unmap(); }

  [[nodiscard]] std::span<const std::byte> bytes() const noexcept { return {data_, size_}; }

 private:
  void unmap() noexcept {
    if (data_ != nullptr) ::munmap(const_cast<std::byte*>(data_), size_);
    data_ = nullptr;
  }
  const std::byte* data_ = nullptr;
  std::size_t size_ = 0;
};

/// "<name>.tmp.": the prefix of AtomicFileWriter's temporary files for target `name`.
[[nodiscard]] inline std::string temp_prefix(const std::filesystem::path& target) {
  return detail::message(target.filename().string(), ".tmp.");
}

/// Parses "<decimal pid>.<decimal counter>" (the tail of a temp file name); 0 if malformed.
[[nodiscard]] inline pid_t temp_owner_pid(std::string_view tail) noexcept {
  const std::size_t dot = tail.find('.');
  if (dot == 0 || dot == std::string_view::npos || dot + 1 == tail.size()) return 0;
  std::uint64_t pid = 0;
  for (std::size_t i = 0; i < dot; ++i) {
    if (tail[i] < '0' || tail[i] > '9' || pid > 100000000) return 0;
    pid = pid * 10 + static_cast<std::uint64_t>(tail[i] - '0');
  }
  for (std::size_t i = dot + 1; i < tail.size(); ++i) {
    if (tail[i] < '0' || tail[i] > '9') return 0;
  }
  return static_cast<pid_t>(pid);
}

/// The directory a target lives in ("." for a bare file name).
[[nodiscard]] inline std::filesystem::path parent_dir(const std::filesystem::path& target) {
  return target.has_parent_path() ? target.parent_path() : std::filesystem::path(".");
}

}  // namespace detail

/// Removes temporary files left next to `target` by AtomicFileWriters whose process is gone
/// (killed mid-save): files named "<target name>.tmp.<pid>.<n>" whose pid no longer exists
/// (kill(pid, 0) fails with ESRCH). Temporaries of live processes, including this one, are
/// kept, so concurrent savers are safe. Assumes one PID namespace per directory (not across
/// hosts on a network file system).
/// @return the number of files removed (0 when the directory does not exist).
/// @throws io_error if the directory cannot be read.
inline std::size_t remove_stale_temp_files(const std::filesystem::path& target) {
  const std::filesystem::path dir = detail::parent_dir(target);
  const std::string prefix = detail::temp_prefix(target);
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) {
    if (errno == ENOENT) return 0;  // no directory, no temporaries
    throw io_error(detail::message("opendir '", dir.string(), "'"), errno);
  }
  std::vector<std::string> stale;
  errno = 0;
  while (const dirent* entry = ::readdir(d)) {
    const std::string_view name(entry->d_name);
    if (name.size() <= prefix.size() || name.substr(0, prefix.size()) != prefix) continue;
    const pid_t pid = detail::temp_owner_pid(name.substr(prefix.size()));
    if (pid > 0 && ::kill(pid, 0) != 0 && errno == ESRCH) stale.emplace_back(name);
    errno = 0;
  }
  ::closedir(d);
  std::size_t removed = 0;
  for (const std::string& name : stale) {
    if (::unlink((dir / name).c_str()) == 0) ++removed;  // ENOENT: another cleaner was first
  }
  return removed;
}

/// Replaces a file atomically: bytes go to a new temporary "<target>.tmp.<pid>.<n>" in the
/// target's directory; commit() fsyncs it, renames it over the target and fsyncs the directory.
/// Readers see the old file or the new one, never a mix, even if this process is killed at any
/// moment or (with durable = true) the machine loses power. Without commit() (an exception, a
/// destructor) the temporary is removed; a killed process leaves it behind, for
/// remove_stale_temp_files().
class AtomicFileWriter {
 public:
  /// Creates the temporary file (mode 0644 minus the umask).
  /// @param durable fsync the data before the rename and the directory after it.
  /// @throws io_error (e.g. the directory does not exist or is not writable).
  explicit AtomicFileWriter(std::filesystem::path target, bool durable = true)
      : target_(std::move(target)), durable_(durable) {
    static std::atomic<std::uint64_t> counter{0};
    const std::filesystem::path dir = detail::parent_dir(target_);
    for (;;) {
      temp_ = dir /
              detail::message(detail::temp_prefix(target_), ::getpid(), ".", counter.fetch_add(1));
      const int fd = ::open(temp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
      if (fd >= 0) {
        fd_ = detail::UniqueFd(fd);
        return;
      }
      if (errno != EEXIST && errno != EINTR) {
        throw io_error(detail::message("create temporary file '", temp_.string(), "'"), errno);
      }
    }
  }
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;
  ~AtomicFileWriter() {
    if (!committed_) {
      fd_.reset();
      ::unlink(temp_.c_str());
    }
  }

  [[nodiscard]] int fd() const noexcept { return fd_.get(); }
  [[nodiscard]] const std::filesystem::path& temp_path() const noexcept { return temp_; }
  [[nodiscard]] const std::filesystem::path& target() const noexcept { return target_; }

  /// Appends bytes at the current end. @throws io_error.
  void write(std::span<const std::byte> bytes) {
    detail::write_all(fd_.get(), bytes.data(), bytes.size(), temp_);
  }
  /// Overwrites bytes at `offset` (e.g. a header written last). @throws io_error.
  void write_at(std::span<const std::byte> bytes, std::uint64_t offset) {
    detail::pwrite_all(fd_.get(), bytes.data(), bytes.size(), offset, temp_);
  }

  /// Makes the new contents the target's: fsync (if durable), close, rename over the target,
  /// fsync the directory (if durable). @throws io_error; before the rename the target is
  /// untouched and the temporary is removed by the destructor.
  void commit() {
    if (durable_) detail::fsync_checked(fd_.get(), temp_);
    fd_.close_checked(temp_);
    if (::rename(temp_.c_str(), target_.c_str()) != 0) {
      throw io_error(detail::message("rename '", temp_.string(), "' to '", target_.string(), "'"),
                     errno);
    }
    committed_ = true;
    if (durable_) {
      const std::filesystem::path dir = detail::parent_dir(target_);
      detail::UniqueFd dfd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
      if (!dfd) throw io_error(detail::message("open directory '", dir.string(), "'"), errno);
      detail::fsync_checked(dfd.get(), dir);
    }
  }

 private:
  std::filesystem::path target_;
  std::filesystem::path temp_;
  detail::UniqueFd fd_;
  bool durable_;
  bool committed_ = false;
};

}  // namespace kvcache
