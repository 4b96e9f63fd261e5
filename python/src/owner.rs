//! One thread owns each kiln session: CUDA handles (cuBLASLt, events, the context's binding)
//! belong to the thread that made them, while Python calls come from any thread. A call sends
//! a closure to the owning thread and waits for its result (with the GIL released by the
//! caller), so calls on one object run one at a time, in arrival order. `kiln serve`'s worker
//! owns its generator the same way.

use std::sync::mpsc::{channel, sync_channel, Sender};

use kiln_host::{Error, Result};

type Job<T> = Box<dyn FnOnce(&mut T) + Send>;

/// A value that lives on its own thread; dropping the owner ends the thread, which drops it.
pub struct Owner<T> {
    jobs: Sender<Job<T>>,
}

impl<T: 'static> Owner<T> {
    /// Starts the thread and makes the value there. Errors: `make`'s, or no thread.
    pub fn new(name: &str, make: impl FnOnce() -> Result<T> + Send + 'static) -> Result<Owner<T>> {
        let (jobs, queue) = channel::<Job<T>>();
        let (ready, made) = channel::<Result<()>>();
        std::thread::Builder::new()
            .name(name.to_string())
            .spawn(move || {
                let mut value = match make() {
                    Ok(v) => v,
                    Err(e) => {
                        let _ = ready.send(Err(e));
                        return;
                    }
                };
                let _ = ready.send(Ok(()));
                for job in queue {
                    job(&mut value);
                }
            })
            .map_err(|e| Error::Device(format!("starting the session's thread: {e}")))?;
        made.recv().map_err(|_| Error::Device("the session's thread ended while loading".into()))??;
        Ok(Owner { jobs })
    }

    /// Runs `f` on the owning thread and returns its result.
    pub fn call<R: Send + 'static>(&self, f: impl FnOnce(&mut T) -> R + Send + 'static) -> Result<R> {
        let (tx, rx) = sync_channel(1);
        self.jobs
            .send(Box::new(move |v| {
                let _ = tx.send(f(v));
            }))
            .map_err(|_| Error::Device("the session's thread has ended".into()))?;
        rx.recv().map_err(|_| Error::Device("the session's thread ended during the call (a panic)".into()))
    }
}
