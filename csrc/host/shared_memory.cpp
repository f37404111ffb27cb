#include "shared_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <utility>

#include "../common.h"

namespace llamarl {
namespace {

std::string random_shm_name() {
  unsigned char bytes[16];
  FILE* urandom = std::fopen("/dev/urandom", "rb");
  LLAMARL_CHECK(urandom != nullptr, "cannot open /dev/urandom: " << std::strerror(errno));
  const size_t got = std::fread(bytes, 1, sizeof(bytes), urandom);
  std::fclose(urandom);
  LLAMARL_CHECK(got == sizeof(bytes), "short read from /dev/urandom");
  static const char* hex = "0123456789abcdef";
  std::string name = "/llamarl-" + std::to_string(getpid()) + "-";
  for (unsigned char b : bytes) {
    name.push_back(hex[b >> 4]);
    name.push_back(hex[b & 15]);
  }
  return name;
}

// Free bytes of the file system holding `fd` (what an unprivileged user may still take).
std::string free_bytes(int fd) {
  struct statvfs fs {};
  if (fstatvfs(fd, &fs) != 0) return std::string("an unknown number of bytes (") + std::strerror(errno) + ")";
  return std::to_string(static_cast<unsigned long long>(fs.f_bavail) * fs.f_frsize) + " bytes";
}

}  // namespace

// On failure the half-built region's destructor closes the descriptor.
void SharedMemoryRegion::map(int64_t nbytes) {
  // MAP_POPULATE: a peer writing 1 GiB through a fresh mapping would otherwise take
  // 262,144 minor page faults (4 KiB pages) during its first sync.
  void* data = mmap(nullptr, static_cast<size_t>(nbytes), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd_, 0);
  LLAMARL_CHECK(data != MAP_FAILED, "mmap of " << nbytes << " bytes of shared memory " << name_
                                               << " failed: " << std::strerror(errno));
  data_ = data;
  nbytes_ = nbytes;
}

// Allocate every page now, not on first touch: with ftruncate alone an 8 MiB region
// on a 1 MiB /dev/shm (Docker's default is 64 MiB) is created and mapped without
// complaint, MAP_POPULATE silently stops at the first page it cannot get, and the
// first write past it kills the process with SIGBUS.
void SharedMemoryRegion::reserve(int64_t nbytes) {
  int err = 0;
  // tmpfs gives up with EINTR when a signal arrives during a large allocation
  // (and frees what it took): retry, the caller asked for the whole region.
  do {
    err = posix_fallocate(fd_, 0, static_cast<off_t>(nbytes));  // returns the error, leaves errno alone
  } while (err == EINTR);
  LLAMARL_CHECK(err != ENOSPC, "shared memory region needs " << nbytes << " bytes, /dev/shm has " << free_bytes(fd_)
                                << " free (statvfs): enlarge it (e.g. docker run --shm-size=...) or use "
                                   "transport='p2p'");
  LLAMARL_CHECK(err == 0, "posix_fallocate of " << nbytes << " bytes of shared memory failed: " << std::strerror(err));
}

SharedMemoryRegion SharedMemoryRegion::create(int64_t nbytes) {
  LLAMARL_CHECK(nbytes > 0, "shared memory region size must be positive, got " << nbytes);
  SharedMemoryRegion region;
  region.name_ = random_shm_name();
  region.fd_ = shm_open(region.name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  LLAMARL_CHECK(region.fd_ >= 0, "shm_open(" << region.name_ << ") failed: " << std::strerror(errno));
  // Unlink at once: the descriptor keeps the memory alive, and no crash can leak the name.
  shm_unlink(region.name_.c_str());
  region.owner_ = true;
  region.reserve(nbytes);
  region.map(nbytes);
  return region;
}

SharedMemoryRegion SharedMemoryRegion::open(int64_t owner_pid, int64_t owner_fd, const std::string& name,
                                            int64_t nbytes) {
  const std::string link = "/proc/" + std::to_string(owner_pid) + "/fd/" + std::to_string(owner_fd);
  char target[512];
  const ssize_t len = readlink(link.c_str(), target, sizeof(target) - 1);
  LLAMARL_CHECK(len > 0, "cannot read " << link << " (is process " << owner_pid
                                        << " alive and run by this user?): " << std::strerror(errno));
  target[len] = '\0';
  const std::string expected = "/dev/shm" + name + " (deleted)";
  LLAMARL_CHECK(expected == target, link << " points at '" << target << "', expected '" << expected
                                         << "': the exporting process closed the region");
  SharedMemoryRegion region;
  region.fd_ = ::open(link.c_str(), O_RDWR | O_CLOEXEC);
  LLAMARL_CHECK(region.fd_ >= 0, "open(" << link << ") failed: " << std::strerror(errno));
  region.name_ = name;
  struct stat info {};
  LLAMARL_CHECK(fstat(region.fd_, &info) == 0, "fstat of " << link << " failed: " << std::strerror(errno));
  LLAMARL_CHECK(info.st_size == nbytes, "shared memory " << name << " has " << info.st_size << " bytes, expected "
                                                        << nbytes);
  region.map(nbytes);
  // The mapping keeps the memory: a peer holds no descriptor (a sender maps one region per
  // storage of every receiver it writes, hundreds for a model, and descriptors run out first).
  ::close(region.fd_);
  region.fd_ = -1;
  return region;
}

SharedMemoryRegion::SharedMemoryRegion(SharedMemoryRegion&& other) noexcept { *this = std::move(other); }

SharedMemoryRegion& SharedMemoryRegion::operator=(SharedMemoryRegion&& other) noexcept {
  if (this != &other) {
    close();
    std::swap(data_, other.data_);
    std::swap(nbytes_, other.nbytes_);
    std::swap(fd_, other.fd_);
    std::swap(name_, other.name_);
    std::swap(owner_, other.owner_);
  }
  return *this;
}

SharedMemoryRegion::~SharedMemoryRegion() { close(); }

void SharedMemoryRegion::close() {
  if (data_ != nullptr) munmap(data_, static_cast<size_t>(nbytes_));
  if (fd_ >= 0) ::close(fd_);
  data_ = nullptr;
  fd_ = -1;
  nbytes_ = 0;
}

}  // namespace llamarl
