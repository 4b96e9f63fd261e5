//! Loops shared out to the kept-hot threads of the running CPU session
//! ([`super::cpu_pool::on_pool_hot`]) without rayon's fork-join: the session's thread publishes
//! one job, items `0..n`, and every thread that is free (the publisher and each spinning helper)
//! takes the next chunk of items from one counter until none is left, as onnxruntime's spinning
//! intra-op threads take a parallel loop's blocks. A decode step's matrix products last tens of
//! µs; splitting each into a tree of rayon jobs that idle threads steal made every helper poll
//! every other thread's deque, and a product's threads join one after another.
//!
//! Off unless `KILN_CPU_SHARE=1`: on a 2-core VM it was 2–4 % slower than rayon's tasks at two
//! threads (bench/RESULTS.md, session 38); whether it pays where it should, at 16 threads, is an
//! A/B for a 16-core machine (`scripts/gpu-check.sh cpu`).

use std::any::Any;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
#[cfg(test)]
use std::sync::atomic::AtomicBool;
use std::sync::atomic::{AtomicPtr, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

/// One published loop. It lives on its publisher's stack: [`share`] returns only after it is
/// unpublished and no helper is inside it.
struct Job<'a> {
    /// Runs items `start..end`.
    run: &'a (dyn Fn(usize, usize) + Sync),
    n: usize,
    chunk: usize,
    /// The first item no thread has taken yet.
    next: AtomicUsize,
    /// Items finished.
    done: AtomicUsize,
    /// The first panic of a chunk, which the publisher resumes after the loop.
    panic: Mutex<Option<Box<dyn Any + Send>>>,
}

/// The published job (a `Job` with its lifetime erased), or null.
static JOB: AtomicPtr<Job<'static>> = AtomicPtr::new(std::ptr::null_mut());
/// Helpers that may be reading the published job: each counts itself in before it loads
/// [`JOB`] and out after its last touch, so the publisher waits for none left before it returns.
static INSIDE: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// Whether this thread runs a hot session's graph, which publishes jobs (its own nodes', or
    /// another session's it runs while it waits in a rayon join).
    static PUBLISHER: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Tests of the loops that share their work turn sharing on whatever `KILN_CPU_SHARE` says.
#[cfg(test)]
pub(super) static FORCE: AtomicBool = AtomicBool::new(false);

/// Whether shared loops are on (`KILN_CPU_SHARE=1`).
fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    #[cfg(test)]
    if FORCE.load(Ordering::Relaxed) {
        return true;
    }
    *ON.get_or_init(|| std::env::var("KILN_CPU_SHARE").is_ok_and(|v| v.trim() == "1"))
}

/// Spins while `busy()`, offering the core to other threads every 64 spins (a helper the
/// publisher waits for may have been descheduled on its core).
fn spin_while(busy: impl Fn() -> bool) {
    let mut spins = 0u32;
    while busy() {
        spins = spins.wrapping_add(1);
        if spins.is_multiple_of(64) {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
}

/// Marks (or unmarks) this thread as the one running the hot session's graph.
pub(super) fn set_publisher(on: bool) {
    PUBLISHER.with(|p| p.set(on));
}

/// Runs `run(start, end)` over items `0..n` in chunks of `chunk` (the last one shorter), shared
/// with the hot session's helpers, and returns true; or returns false at once, having run
/// nothing, when this thread runs no hot session's graph, another loop is published (a loop
/// inside a chunk) or shared loops are off: the caller then runs them its own way. A panic in a
/// chunk reaches the caller after every other chunk has run.
pub(super) fn share(n: usize, chunk: usize, run: &(dyn Fn(usize, usize) + Sync)) -> bool {
    enabled() && share_on(n, chunk, run)
}

/// [`share`] whether or not `KILN_CPU_SHARE` turns it on.
fn share_on(n: usize, chunk: usize, run: &(dyn Fn(usize, usize) + Sync)) -> bool {
    if !PUBLISHER.with(|p| p.get()) {
        return false;
    }
    let chunk = chunk.max(1);
    let job = Job { run, n, chunk, next: AtomicUsize::new(0), done: AtomicUsize::new(0), panic: Mutex::new(None) };
    // SAFETY (of the erased lifetime): the job is unpublished below, and this function returns
    // only once no helper is inside it.
    let ptr = &job as *const Job<'_> as *mut Job<'static>;
    if JOB.compare_exchange(std::ptr::null_mut(), ptr, Ordering::SeqCst, Ordering::SeqCst).is_err() {
        return false;
    }
    take_chunks(&job);
    spin_while(|| job.done.load(Ordering::Acquire) < n);
    JOB.store(std::ptr::null_mut(), Ordering::SeqCst);
    spin_while(|| INSIDE.load(Ordering::SeqCst) != 0);
    if let Some(payload) = job.panic.lock().ok().and_then(|mut p| p.take()) {
        resume_unwind(payload);
    }
    true
}

/// A kept-hot helper's look for a published job: takes its chunks until none is left. Returns
/// whether it ran any. It looks first without counting itself in: one load of a shared pointer.
pub(super) fn help() -> bool {
    if JOB.load(Ordering::Relaxed).is_null() {
        return false;
    }
    INSIDE.fetch_add(1, Ordering::SeqCst);
    let ptr = JOB.load(Ordering::SeqCst);
    // SAFETY: a non-null pointer loaded after counting in names a job whose publisher waits for
    // INSIDE to reach 0 after unpublishing it, so the job outlives this use.
    let ran = !ptr.is_null() && take_chunks(unsafe { &*ptr });
    INSIDE.fetch_sub(1, Ordering::SeqCst);
    ran
}

/// Takes and runs chunks of `job` until none is left; returns whether it ran any.
fn take_chunks(job: &Job<'_>) -> bool {
    let mut ran = false;
    loop {
        // A look before the counter is taken: idle helpers do not write it once it is spent.
        if job.next.load(Ordering::Relaxed) >= job.n {
            return ran;
        }
        let start = job.next.fetch_add(job.chunk, Ordering::Relaxed);
        if start >= job.n {
            return ran;
        }
        let end = (start + job.chunk).min(job.n);
        if let Err(payload) = catch_unwind(AssertUnwindSafe(|| (job.run)(start, end))) {
            if let Ok(mut p) = job.panic.lock() {
                p.get_or_insert(payload);
            }
        }
        job.done.fetch_add(end - start, Ordering::Release);
        ran = true;
    }
}

#[cfg(test)]
pub(super) mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};

    use super::share_on;
    use crate::sandbox::cpu_pool::{cpu_threads, hot_spin, on_pool_hot};

    /// Runs `f` in a hot run that shares loops (retried while another test's hot run holds the
    /// pool); `None` with one CPU thread or no kept-hot helpers, where no run is hot.
    pub(in crate::sandbox) fn hot<R: Send>(f: impl Fn() -> R + Send + Sync) -> Option<R> {
        for _ in 0..500 {
            if let Some(r) = on_pool_hot(|| share_on(0, 1, &|_, _| {}).then(&f)) {
                return Some(r);
            }
            if cpu_threads() == 1 || hot_spin().is_zero() {
                return None;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        panic!("no hot run shared a loop in 500 tries");
    }

    /// Inside a hot run every item runs exactly once, over many loops of odd sizes and chunks;
    /// outside one nothing runs and `share` says so; a panicking chunk reaches the publisher after
    /// the rest, and the next loop works.
    #[test]
    fn every_item_runs_once_and_a_panic_reaches_the_publisher() {
        let counts: Vec<AtomicU32> = (0..1000).map(|_| AtomicU32::new(0)).collect();
        let count = |a: usize, b: usize| (a..b).for_each(|i| _ = counts[i].fetch_add(1, Ordering::Relaxed));
        assert!(!share_on(10, 1, &count), "no hot run: not shared");
        let size = |round: usize| round * 16 + round % 7;
        let Some(all) = hot(|| (1..=60).all(|round| share_on(size(round), round % 5 + 1, &count))) else {
            return; // One CPU thread: nothing to share with.
        };
        assert!(all, "every loop was shared");
        for (i, c) in counts.iter().enumerate() {
            let want = (1..=60).filter(|&round| i < size(round)).count() as u32;
            assert_eq!(c.load(Ordering::Relaxed), want, "item {i}");
        }
        let ran = AtomicU32::new(0);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            hot(|| {
                share_on(64, 1, &|a, _| {
                    ran.fetch_add(1, Ordering::Relaxed);
                    assert!(a != 40, "chunk 40 fails");
                })
            })
        }));
        assert!(r.is_err(), "the chunk's panic reaches the caller");
        assert_eq!(ran.load(Ordering::Relaxed), 64, "every other chunk ran");
        assert_eq!(hot(|| share_on(8, 3, &|_, _| {})), Some(true), "the next loop is shared");
        // The helpers take chunks too: 32 chunks of 200 µs each do not all go to the publisher.
        let threads = std::sync::Mutex::new(std::collections::HashSet::new());
        hot(|| {
            share_on(32, 1, &|_, _| {
                threads.lock().unwrap().insert(std::thread::current().id());
                std::thread::sleep(std::time::Duration::from_micros(200));
            })
        });
        assert!(threads.lock().unwrap().len() > 1, "only the publisher ran chunks");
    }
}
