// POSIX shared memory regions: the host transport's exported memory.
//
// The owner creates the object under an unguessable name (128 random bits) with
// mode 0600 and unlinks the name at once, keeping only its file descriptor, so
// nothing is left in /dev/shm even if every process is killed. A peer of the same
// user opens it through /proc/<owner pid>/fd/<fd>, after checking that this
// descriptor still points at the name it was told.
#pragma once

#include <cstdint>
#include <string>

namespace llamarl {

class SharedMemoryRegion {
 public:
  // Owner side: a new zero-filled region of `nbytes` bytes, every page allocated
  // up front: throws naming the bytes needed and free if /dev/shm lacks them.
  static SharedMemoryRegion create(int64_t nbytes);
  // Peer side: map a region exported by process `owner_pid` as descriptor `owner_fd`
  // (any owner's, torch's shared storages among them; the peer keeps no descriptor).
  static SharedMemoryRegion open(int64_t owner_pid, int64_t owner_fd, const std::string& name,
                                 int64_t nbytes);

  SharedMemoryRegion(SharedMemoryRegion&& other) noexcept;
  SharedMemoryRegion& operator=(SharedMemoryRegion&& other) noexcept;
  SharedMemoryRegion(const SharedMemoryRegion&) = delete;
  SharedMemoryRegion& operator=(const SharedMemoryRegion&) = delete;
  ~SharedMemoryRegion();

  void close();
  bool is_open() const { return data_ != nullptr; }
  int64_t address() const { return reinterpret_cast<int64_t>(data_); }
  int64_t nbytes() const { return nbytes_; }
  int fd() const { return fd_; }
  const std::string& name() const { return name_; }
  bool is_owner() const { return owner_; }

 private:
  SharedMemoryRegion() = default;
  void reserve(int64_t nbytes);  // allocate every page of the descriptor, or throw
  void map(int64_t nbytes);
  void* data_ = nullptr;
  int64_t nbytes_ = 0;
  int fd_ = -1;
  std::string name_;
  bool owner_ = false;
};

}  // namespace llamarl
