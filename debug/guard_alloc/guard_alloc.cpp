// Debug CPU allocator for torch (debug/guard_alloc/sitecustomize.py loads it): every tensor on its own
// pages with a PROT_NONE page after it, and freed blocks kept PROT_NONE in a quarantine, so a write
// after free or past the end faults at the writer; SIGSEGV/SIGBUS/SIGABRT print the native stack.
#include <torch/extension.h>
#include <c10/core/CPUAllocator.h>
#include <sys/mman.h>
#include <unistd.h>
#include <deque>
#include <mutex>
#include <cstring>
#include <cstdio>
#include <atomic>
#include <execinfo.h>
#include <signal.h>

namespace {
constexpr size_t kPage = 4096;
std::mutex mu;
std::deque<std::pair<void*, size_t>> quarantine;
size_t max_quarantine = 20000;
std::atomic<size_t> n_alloc{0};

void guard_delete(void* ctx) {
  if (!ctx) return;
  char* base = static_cast<char*>(ctx);
  size_t total = *reinterpret_cast<size_t*>(base);
  madvise(base, total, MADV_DONTNEED);
  if (mprotect(base, total, PROT_NONE) != 0) { perror("guard mprotect free"); abort(); }
  std::pair<void*, size_t> old{nullptr, 0};
  {
    std::lock_guard<std::mutex> g(mu);
    quarantine.emplace_back(base, total);
    if (quarantine.size() > max_quarantine) { old = quarantine.front(); quarantine.pop_front(); }
  }
  if (old.first) munmap(old.first, old.second);
}

struct GuardAllocator final : at::Allocator {
  at::DataPtr allocate(size_t n) override {
    if (n == 0) return {nullptr, nullptr, &guard_delete, at::Device(at::DeviceType::CPU)};
    size_t data_bytes = (n + 63) & ~size_t(63);
    size_t pages = (n + 64 + kPage - 1) / kPage;
    size_t total = pages * kPage;
    char* base = static_cast<char*>(mmap(nullptr, total + kPage, PROT_READ | PROT_WRITE,
                                         MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
    if (base == MAP_FAILED) { perror("guard mmap"); abort(); }
    if (mprotect(base + total, kPage, PROT_NONE) != 0) { perror("guard mprotect"); abort(); }
    *reinterpret_cast<size_t*>(base) = total + kPage;
    char* data = base + total - data_bytes;
    n_alloc++;
    return {data, base, &guard_delete, at::Device(at::DeviceType::CPU)};
  }
  at::DeleterFnPtr raw_deleter() const override { return nullptr; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
};
GuardAllocator g_alloc;
void on_segv(int sig, siginfo_t* info, void*) {
  char buf[128];
  int len = snprintf(buf, sizeof buf, "\n[guard_alloc] signal %d at address %p, thread %ld\n", sig, info->si_addr, (long)gettid());
  write(2, buf, len);
  void* frames[64];
  int n = backtrace(frames, 64);
  backtrace_symbols_fd(frames, n, 2);
  signal(sig, SIG_DFL);
  raise(sig);
}
}  // namespace

void install(int64_t quarantine_entries) {
  max_quarantine = quarantine_entries;
  c10::SetCPUAllocator(&g_alloc, /*priority=*/100);
  struct sigaction sa {};
  sa.sa_sigaction = on_segv;
  sa.sa_flags = SA_SIGINFO;
  sigaction(SIGSEGV, &sa, nullptr);
  sigaction(SIGBUS, &sa, nullptr);
  sigaction(SIGABRT, &sa, nullptr);
}
int64_t allocations() { return n_alloc.load(); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("install", &install);
  m.def("allocations", &allocations);
}
