//! Runs seeded test cases one at a time, each on a thread of its own named after it, so that a
//! panic is caught and a hang is noticed, and the report names the seed and index of the case
//! that did either (a case is made from its seed and index alone, so they reproduce it).
//!
//! An abort cannot be caught in the process; [`AllocGuard`] turns the usual one, an allocation
//! of a size read from the input, into an abort that names the case first (and into a failure
//! on machines with enough memory to have granted it).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use crate::Rng;

thread_local! {
    /// The seed and index of the case this thread runs, for [`AllocGuard`] (constant
    /// initialization: reading it never allocates).
    static CURRENT: Cell<Option<(u64, u64)>> = const { Cell::new(None) };
}

/// A case that did not end with a result.
#[derive(Clone, Debug, PartialEq)]
pub enum Failure {
    /// The case panicked: its index, its description and the panic's message.
    Panicked { index: usize, case: String, message: String },
    /// The case ran past the time limit (no later case was run).
    Hung { index: usize, case: String, limit: Duration },
}

/// What [`run_cases`] saw.
#[derive(Debug)]
pub struct Report<O> {
    pub seed: u64,
    /// Each finished case's index, description and outcome, in order.
    pub outcomes: Vec<(usize, String, O)>,
    pub failures: Vec<Failure>,
    pub elapsed: Duration,
}

impl<O> Report<O> {
    /// One line per failure, each with what reproduces it.
    pub fn failures_text(&self) -> String {
        let seed = self.seed;
        self.failures
            .iter()
            .map(|f| match f {
                Failure::Panicked { index, case, message } => {
                    format!("seed {seed:#x} case {index} ({case}) panicked: {message}")
                }
                Failure::Hung { index, case, limit } => {
                    format!("seed {seed:#x} case {index} ({case}) ran past {limit:?}")
                }
            })
            .collect::<Vec<_>>()
            .join("\n")
    }
}

/// The generator of case `index` of `seed`: independent of every other case's.
pub fn case_rng(seed: u64, index: usize) -> Rng {
    let mut r = Rng(seed ^ (index as u64).wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    r.next_u64();
    r
}

/// Makes each case of `indices` with `make` (from [`case_rng`]; it returns the case's
/// description and the case) and runs it with `run` on a new thread, waiting at most `limit`.
/// A panic (in either) is recorded and the next case runs; a case past `limit` is recorded and
/// ends the run (its thread is left behind).
pub fn run_cases<C, O>(
    seed: u64,
    indices: impl IntoIterator<Item = usize>,
    limit: Duration,
    make: impl Fn(&mut Rng, usize) -> (String, C) + Send + Sync + 'static,
    run: impl Fn(C) -> O + Send + Sync + 'static,
) -> Report<O>
where
    O: Send + 'static,
{
    let started = Instant::now();
    let make = Arc::new(make);
    let run = Arc::new(run);
    let mut report = Report { seed, outcomes: Vec::new(), failures: Vec::new(), elapsed: Duration::ZERO };
    for index in indices {
        let (tx, rx) = mpsc::channel();
        let (make, run) = (make.clone(), run.clone());
        let spawned = std::thread::Builder::new().name(format!("case {index} of seed {seed:#x}")).spawn(move || {
            CURRENT.set(Some((seed, index as u64)));
            let (case, c) = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                make(&mut case_rng(seed, index), index)
            })) {
                Ok(made) => made,
                Err(p) => {
                    let _ = tx.send((String::from("(making the case)"), Err(panic_text(p))));
                    return;
                }
            };
            let _ = tx.send((case.clone(), Ok(None)));
            let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run(c))).map_err(panic_text);
            let _ = tx.send((case, out.map(Some)));
        });
        if let Err(e) = spawned {
            panic!("no thread for case {index}: {e}");
        }
        let deadline = Instant::now() + limit;
        let mut case = String::from("(making the case)");
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok((c, Ok(None))) => case = c,
                Ok((c, Ok(Some(o)))) => {
                    report.outcomes.push((index, c, o));
                    break;
                }
                Ok((c, Err(message))) => {
                    report.failures.push(Failure::Panicked { index, case: c, message });
                    break;
                }
                Err(_) => {
                    report.failures.push(Failure::Hung { index, case, limit });
                    report.elapsed = started.elapsed();
                    return report;
                }
            }
        }
    }
    report.elapsed = started.elapsed();
    report
}

fn panic_text(p: Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(a panic without a message)".into())
}

/// A global allocator (the system's) that refuses any one request over `limit` bytes after
/// writing which case made it to stderr; the process then aborts as Rust does when memory runs
/// out. Declare it in a test binary: `#[global_allocator] static A: AllocGuard = AllocGuard(1 << 30);`
pub struct AllocGuard(pub usize);

impl AllocGuard {
    #[cold]
    fn refuse(&self, size: usize) {
        use std::io::Write;
        let mut buf = [0u8; 200];
        let mut w = &mut buf[..];
        let _ = match CURRENT.try_with(Cell::get).ok().flatten() {
            Some((seed, index)) => {
                writeln!(w, "AllocGuard: seed {seed:#x} case {index} asked for {size} bytes (over {})", self.0)
            }
            None => writeln!(w, "AllocGuard: a request for {size} bytes (over {}), outside any case", self.0),
        };
        let n = 200 - w.len();
        let _ = std::io::stderr().write_all(&buf[..n]);
    }
}

// SAFETY: every call is forwarded to `System` unchanged, or refused with a null pointer, which
// the `GlobalAlloc` contract allows.
unsafe impl GlobalAlloc for AllocGuard {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if layout.size() > self.0 {
            self.refuse(layout.size());
            return std::ptr::null_mut();
        }
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if layout.size() > self.0 {
            self.refuse(layout.size());
            return std::ptr::null_mut();
        }
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if new_size > self.0 {
            self.refuse(new_size);
            return std::ptr::null_mut();
        }
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}
