//! The `idemgate` command line; all of it is [`idemgate::server::run`].

/// mimalloc instead of the system allocator: the request path allocates and
/// frees many small buffers (headers, JSON, rows), and glibc's malloc, free and
/// memmove were the largest user-space items in its profile. Only the binary
/// chooses; the library leaves the allocator to whoever embeds it.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    idemgate::server::run(std::env::args_os().collect()).await
}
