//! The CPU pool: the rayon threads that the host's CPU work runs on (`gemm`, `conv`, `qgemm`
//! in `kiln_cpu` calls, and a CPU session's graph itself), `KILN_CPU_THREADS` of them (default:
//! every core the process may use).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The threads CPU work uses: `KILN_CPU_THREADS` when it is a positive number, else every core
/// the process may use (another value is reported once, as a warning, and ignored).
pub fn cpu_threads() -> usize {
    static THREADS: OnceLock<usize> = OnceLock::new();
    *THREADS.get_or_init(|| {
        let cores = std::thread::available_parallelism().map_or(1, usize::from);
        match std::env::var("KILN_CPU_THREADS") {
            Err(_) => cores,
            Ok(v) => match v.trim().parse::<usize>() {
                Ok(n) if n > 0 => n,
                _ => {
                    tracing::warn!("KILN_CPU_THREADS={v:?} is not a positive number of threads; using {cores}");
                    cores
                }
            },
        }
    })
}

/// Native stack of the pool's threads: a CPU session runs its nodes there, Wasm shims included.
const POOL_STACK_BYTES: usize = 16 << 20;

/// Keeps freed host memory in the process for reuse (glibc): a CPU session allocates each
/// node's output afresh, megabytes in a prompt, and by default glibc maps such blocks anew
/// (`mmap` above a threshold that adapts only up to 32 MiB) and gives freed heap tops back to the
/// OS, so every node's first writes page-faulted fresh zeroed pages: a quarter of a 256-token CPU
/// prefill went to the kernel clearing pages. Blocks up to 64 MiB now come from the heap and
/// the heap keeps up to 1 GiB of free memory, as onnxruntime's arena keeps its blocks.
fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes glibc's allocation parameters; it is called once, before the
    // pool exists.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 64 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
    }
}

/// The pool CPU work runs on (`None`: it could not be made, and it runs on the caller's thread).
pub(super) fn pool() -> Option<&'static rayon::ThreadPool> {
    static POOL: OnceLock<Option<rayon::ThreadPool>> = OnceLock::new();
    POOL.get_or_init(|| {
        keep_freed_memory();
        rayon::ThreadPoolBuilder::new()
            .num_threads(cpu_threads())
            .stack_size(POOL_STACK_BYTES)
            .thread_name(|i| format!("kiln-cpu-{i}"))
            .build()
            .ok()
    })
    .as_ref()
}

/// How long a kept-hot thread of the pool spins without work before it naps between looks, by
/// default.
const HOT_SPIN: Duration = Duration::from_millis(2);

/// How long kept-hot threads spin without work: `KILN_CPU_HOT_SPIN_US` microseconds when it is a
/// number, else [`HOT_SPIN`]. 0 keeps no thread hot: a session's parallel work then wakes the
/// pool's sleeping threads as any other caller's does (an A/B of the spinning; another value is
/// reported once, as a warning, and ignored).
pub(super) fn hot_spin() -> Duration {
    static SPIN: OnceLock<Duration> = OnceLock::new();
    *SPIN.get_or_init(|| match std::env::var("KILN_CPU_HOT_SPIN_US") {
        Err(_) => HOT_SPIN,
        Ok(v) => match v.trim().parse::<u64>() {
            Ok(us) => Duration::from_micros(us),
            Err(_) => {
                tracing::warn!("KILN_CPU_HOT_SPIN_US={v:?} is not a number of microseconds; using {HOT_SPIN:?}");
                HOT_SPIN
            }
        },
    })
}

/// Spins of a kept-hot thread between looks at the clock (a `clock_gettime`) and offers of its
/// core to other threads (a `sched_yield`). Spinning without the offers, on a 2-core VM with a
/// busy process beside kiln, a 2-thread int4 decode step took 27.0 ms against 15.9–17.4 with no
/// spinning at all; with them, 17.1 ms. Unloaded, the two were within that VM's noise
/// (bench/RESULTS.md, session 37).
const SPINS_PER_LOOK: u32 = 64;

/// A kept-hot thread's nap between looks once it has spun [`hot_spin`] without work: the core
/// is free for the OS through a long single-threaded stretch, and the next parallel work waits
/// at most this long for the thread (its first part starts on the thread that shares it out).
const HOT_NAP: Duration = Duration::from_micros(50);

/// Whether a session runs hot on the pool now ([`on_pool_hot`]): one at a time.
static HOT: AtomicBool = AtomicBool::new(false);

/// Parallel sections open on the pool ([`on_pool`]). A kept-hot helper looks for rayon's work
/// only while one is open, and otherwise spins on this word and `cpu_share`'s. Rayon's look
/// (`yield_now`) walks every thread's deque; on a 16-core H100 host a node whose product ran as
/// one task on the graph's thread took 44 µs at 16 threads against 25 at one (bench/RESULTS.md,
/// session 42), the helpers' looks beside it the likely cost (on a core's other hyperthread
/// they share its issue slots).
static OPEN: AtomicUsize = AtomicUsize::new(0);

/// Runs `f` (a CPU session's graph) on one of the CPU pool's threads while the others stay hot:
/// until `f` returns they spin (then nap, [`hot_spin`], [`HOT_NAP`]), taking any parallel work
/// `f`'s nodes share out, instead of sleeping until woken between nodes. Waking a sleeping
/// thread costs tens of µs on a virtual machine, about what a decode step's matrix product
/// takes, so without this a second thread joined each product too late to help (onnxruntime's
/// intra-op threads spin the same way); with `KILN_CPU_SHARE=1` they also take chunks of the
/// loops `f`'s thread shares out (`cpu_share`). One session runs hot at a time; another meanwhile runs `f` on its caller's
/// thread, sharing out its parallel work through the pool as before (so one graph never runs
/// nested inside another's wait).
pub fn on_pool_hot<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    let Some(p) = pool() else { return f() };
    let helpers = p.current_num_threads().saturating_sub(1);
    let spin = hot_spin();
    // A run inside a pool thread (a Loop, Scan or If body) runs inline; without helpers, as a
    // plain install. Neither opens a parallel section: the nodes' own products do.
    if p.current_thread_index().is_some() {
        return f();
    }
    if helpers == 0 || spin.is_zero() {
        return p.install(f);
    }
    if HOT.swap(true, Ordering::Acquire) {
        return f();
    }
    /// Sets a flag to `.1` when dropped, `f` returning or unwinding alike.
    struct SetOnDrop<'a>(&'a AtomicBool, bool);
    impl Drop for SetOnDrop<'_> {
        fn drop(&mut self) {
            self.0.store(self.1, Ordering::Release);
        }
    }
    let _hot = SetOnDrop(&HOT, false);
    p.install(|| {
        let done = AtomicBool::new(false);
        rayon::scope(|s| {
            for _ in 0..helpers {
                s.spawn(|_| {
                    let mut idle_since = Instant::now();
                    let mut spins = 0u32;
                    while !done.load(Ordering::Acquire) {
                        // A loop the graph's thread shares out first (`cpu_share`), then rayon's
                        // work while a parallel section is open.
                        if super::cpu_share::help() {
                            idle_since = Instant::now();
                            spins = 0;
                            continue;
                        }
                        let open = OPEN.load(Ordering::Acquire) > 0;
                        match if open { rayon::yield_now() } else { None } {
                            Some(rayon::Yield::Executed) => {
                                idle_since = Instant::now();
                                spins = 0;
                            }
                            _ if spins < SPINS_PER_LOOK => {
                                spins += 1;
                                std::hint::spin_loop();
                            }
                            // Every SPINS_PER_LOOK idle spins: the clock, and the core offered to
                            // any other runnable thread (sched_yield returns at once when there
                            // is none), so that a spinner never holds a core the graph's thread
                            // or another process waits for.
                            _ if idle_since.elapsed() < spin => {
                                spins = 0;
                                std::thread::yield_now();
                            }
                            _ => std::thread::sleep(HOT_NAP),
                        }
                    }
                });
            }
            // The helpers stop when `f` returns or unwinds; this thread shares loops out until then.
            let _done = SetOnDrop(&done, true);
            super::cpu_share::set_publisher(true);
            struct Unpublish;
            impl Drop for Unpublish {
                fn drop(&mut self) {
                    super::cpu_share::set_publisher(false);
                }
            }
            let _unpublish = Unpublish;
            f()
        })
    })
}

/// Runs `f` on the CPU pool (its rayon work on the pool's threads), or here without one (its
/// rayon calls then go to rayon's global pool); inline when called from one of the pool's
/// threads. While it runs, a hot session's helpers look for its rayon work ([`OPEN`]).
pub fn on_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    match pool() {
        Some(p) => {
            /// Closes the section when dropped, `f` returning or unwinding alike.
            struct Close;
            impl Drop for Close {
                fn drop(&mut self) {
                    OPEN.fetch_sub(1, Ordering::Release);
                }
            }
            OPEN.fetch_add(1, Ordering::Release);
            let _close = Close;
            p.install(f)
        }
        None => f(),
    }
}

#[cfg(test)]
mod tests {
    use super::on_pool_hot;

    /// A panic in a hot run reaches the caller (the spinning helpers stop), and the next hot run
    /// works.
    #[test]
    fn a_panic_in_a_hot_run_reaches_the_caller() {
        let r = std::panic::catch_unwind(|| on_pool_hot(|| -> u32 { panic!("a node panicked") }));
        assert!(r.is_err());
        assert_eq!(on_pool_hot(|| 7), 7);
    }
}
