//! The `idemgate` command line; all of it is [`idemgate::server::run`].

/// mimalloc instead of the system allocator: the request path allocates and
/// frees many small buffers (headers, JSON, rows), and glibc's malloc, free and
/// memmove were the largest user-space items in its profile. Only the binary
/// chooses; the library leaves the allocator to whoever embeds it.
#[cfg(not(feature = "count-alloc"))]
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The same allocator, counting its calls for the benchmark harness
/// (feature `count-alloc`; see `idemgate::server::alloc_count`).
#[cfg(feature = "count-alloc")]
#[global_allocator]
static GLOBAL: &stats_alloc::StatsAlloc<mimalloc::MiMalloc> =
    &idemgate::server::alloc_count::ALLOCATOR;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    idemgate::server::run(std::env::args_os().collect()).await
}
