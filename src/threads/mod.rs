//! A small fork-join thread pool for the forward pass.
//!
//! A decode step runs a few hundred short parallel regions (one per matrix
//! multiply or attention block), each lasting tens of microseconds, so the
//! hand-off must cost far less than that: workers spin on an epoch counter
//! for a while before parking, and the calling thread takes tasks too.
//!
//! Determinism does not depend on this pool: callers split work so that each
//! output element is computed by exactly one task in a fixed order, whichever
//! thread happens to run it.

use std::cell::UnsafeCell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long an idle worker spins before it parks. Long enough to bridge the
/// gap between two parallel regions of one forward pass, short enough that an
/// idle server does not burn a core.
const SPIN_BEFORE_PARK: Duration = Duration::from_millis(2);

type Job = *const (dyn Fn(usize) + Sync);

struct PoolState {
    /// Bumped once per parallel region; workers watch it.
    epoch: AtomicU64,
    /// The current region's task function; valid while `closed` is false.
    job: UnsafeCell<Option<Job>>,
    n_tasks: AtomicUsize,
    next_task: AtomicUsize,
    /// Tasks finished in the current region.
    done_tasks: AtomicUsize,
    /// Workers that joined the current region and have not left it.
    active_workers: AtomicUsize,
    /// Set by the caller once every task is done: no worker may join after.
    closed: AtomicBool,
    panicked: AtomicBool,
    shutdown: AtomicBool,
    sleeping: Vec<AtomicBool>,
}

// SAFETY: `job` is written only by the thread in `ThreadPool::run`, while no
// worker is joined (before publishing a region, or after closing it and
// seeing `active_workers == 0`). A worker dereferences it only after joining
// (incrementing `active_workers`, then seeing `closed == false` for the epoch
// it observed); the SeqCst pairing of `closed`/`active_workers` makes
// "caller saw no worker" and "worker saw the region open" mutually exclusive.
unsafe impl Sync for PoolState {}
// SAFETY: the raw job pointer is only dereferenced under the protocol above.
unsafe impl Send for PoolState {}

/// A fixed set of worker threads plus the caller.
pub struct ThreadPool {
    shared: Arc<PoolState>,
    workers: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for ThreadPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThreadPool")
            .field("threads", &self.threads())
            .finish()
    }
}

impl ThreadPool {
    /// A pool in which `threads` threads (the caller included) share work.
    /// `threads` of 0 or 1 runs everything on the caller.
    pub fn new(threads: usize) -> Self {
        let n_workers = threads.saturating_sub(1);
        let shared = Arc::new(PoolState {
            epoch: AtomicU64::new(0),
            job: UnsafeCell::new(None),
            n_tasks: AtomicUsize::new(0),
            next_task: AtomicUsize::new(0),
            done_tasks: AtomicUsize::new(0),
            active_workers: AtomicUsize::new(0),
            closed: AtomicBool::new(true),
            panicked: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
            sleeping: (0..n_workers).map(|_| AtomicBool::new(false)).collect(),
        });
        let workers = (0..n_workers)
            .map(|i| {
                let shared = Arc::clone(&shared);
                std::thread::Builder::new()
                    .name(format!("inferd-compute-{i}"))
                    .spawn(move || worker_loop(&shared, i))
                    .expect("spawning a compute thread at start-up")
            })
            .collect();
        Self { shared, workers }
    }

    /// Threads that take part in a region, the caller included.
    pub fn threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// Runs `f(0..n_tasks)`, each index exactly once, spread over the pool,
    /// and returns when all are done. The caller works too and never waits
    /// for a worker that has not started: a descheduled worker only means
    /// less parallelism. A panic in a task is re-raised here.
    pub fn run(&self, n_tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        if self.workers.is_empty() || n_tasks <= 1 {
            (0..n_tasks).for_each(f);
            return;
        }
        let s = &*self.shared;
        // SAFETY: the lifetime is erased only for the duration of this call:
        // the region is closed and every joined worker has left before we
        // return.
        let job: Job = unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync), Job>(f) };
        // SAFETY: the previous region is closed with no worker joined, so
        // nobody reads `job` concurrently.
        unsafe { *s.job.get() = Some(job) };
        s.n_tasks.store(n_tasks, Ordering::Relaxed);
        s.next_task.store(0, Ordering::Relaxed);
        s.done_tasks.store(0, Ordering::Relaxed);
        s.closed.store(false, Ordering::SeqCst);
        s.epoch.fetch_add(1, Ordering::SeqCst);
        for (i, sleeping) in s.sleeping.iter().enumerate() {
            if sleeping.load(Ordering::SeqCst) {
                self.workers[i].thread().unpark();
            }
        }
        take_tasks(s, f);
        while s.done_tasks.load(Ordering::Acquire) != n_tasks {
            std::hint::spin_loop();
        }
        s.closed.store(true, Ordering::SeqCst);
        while s.active_workers.load(Ordering::SeqCst) != 0 {
            std::hint::spin_loop();
        }
        // SAFETY: closed, and no worker is joined.
        unsafe { *s.job.get() = None };
        if s.panicked.swap(false, Ordering::AcqRel) {
            panic!("a compute task panicked");
        }
    }

    /// Splits `data` into consecutive chunks of `chunk_len` (the last may be
    /// shorter) and runs `f(chunk_index, chunk)` for each, in parallel.
    pub fn for_each_chunk_mut<T: Send>(
        &self,
        data: &mut [T],
        chunk_len: usize,
        f: &(dyn Fn(usize, &mut [T]) + Sync),
    ) {
        let chunk_len = chunk_len.max(1);
        let len = data.len();
        let n_chunks = len.div_ceil(chunk_len);
        let base = SendPtr(data.as_mut_ptr());
        self.run(n_chunks, &|i| {
            let start = i * chunk_len;
            let end = (start + chunk_len).min(len);
            // SAFETY: `run` hands out each index once, so chunks [start, end)
            // are disjoint and inside `data`, which outlives the region.
            let chunk =
                unsafe { std::slice::from_raw_parts_mut(base.get().add(start), end - start) };
            f(i, chunk);
        });
    }
}

struct SendPtr<T>(*mut T);
// SAFETY: used only to hand disjoint chunks of one slice to pool tasks.
unsafe impl<T: Send> Sync for SendPtr<T> {}
impl<T> SendPtr<T> {
    fn get(&self) -> *mut T {
        self.0
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        self.shared.epoch.fetch_add(1, Ordering::SeqCst);
        for w in &self.workers {
            w.thread().unpark();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

/// Takes and runs tasks until none is left. A panicking task is recorded
/// and still counted as done, so the region always completes.
fn take_tasks(s: &PoolState, f: &(dyn Fn(usize) + Sync)) {
    let n = s.n_tasks.load(Ordering::Relaxed);
    loop {
        let i = s.next_task.fetch_add(1, Ordering::Relaxed);
        if i >= n {
            break;
        }
        if catch_unwind(AssertUnwindSafe(|| f(i))).is_err() {
            s.panicked.store(true, Ordering::Release);
        }
        s.done_tasks.fetch_add(1, Ordering::Release);
    }
}

fn worker_loop(s: &PoolState, index: usize) {
    // The pool starts at epoch 0; a region may be published before this
    // thread first runs, so the starting value must not be read here.
    let mut seen = 0;
    loop {
        let started = Instant::now();
        let mut spins = 0u32;
        loop {
            let now = s.epoch.load(Ordering::SeqCst);
            if now != seen {
                seen = now;
                break;
            }
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(1024) && started.elapsed() > SPIN_BEFORE_PARK {
                s.sleeping[index].store(true, Ordering::SeqCst);
                if s.epoch.load(Ordering::SeqCst) == seen {
                    std::thread::park_timeout(Duration::from_millis(100));
                }
                s.sleeping[index].store(false, Ordering::SeqCst);
            } else {
                std::hint::spin_loop();
            }
        }
        if s.shutdown.load(Ordering::SeqCst) {
            return;
        }
        s.active_workers.fetch_add(1, Ordering::SeqCst);
        if !s.closed.load(Ordering::SeqCst) && s.epoch.load(Ordering::SeqCst) == seen {
            // SAFETY: joined while the region we observed is open: the caller
            // keeps `job` and the closure alive until we leave.
            if let Some(job) = unsafe { *s.job.get() } {
                // SAFETY: as above.
                take_tasks(s, unsafe { &*job });
            }
        }
        s.active_workers.fetch_sub(1, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_task_runs_exactly_once() {
        for threads in [1, 2, 3] {
            let pool = ThreadPool::new(threads);
            for n in [0, 1, 2, 7, 100] {
                let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
                pool.run(n, &|i| {
                    hits[i].fetch_add(1, Ordering::Relaxed);
                });
                assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
            }
        }
    }

    #[test]
    fn chunks_cover_the_slice_once() {
        let pool = ThreadPool::new(2);
        let mut data = vec![0u32; 1001];
        pool.for_each_chunk_mut(&mut data, 64, &|chunk, xs| {
            for (j, x) in xs.iter_mut().enumerate() {
                *x += (chunk * 64 + j) as u32;
            }
        });
        assert!(data.iter().enumerate().all(|(i, &x)| x == i as u32));
    }

    #[test]
    fn survives_idle_park_and_many_regions() {
        let pool = ThreadPool::new(2);
        let total = AtomicUsize::new(0);
        for round in 0..400 {
            if round == 200 {
                std::thread::sleep(Duration::from_millis(5));
            }
            pool.run(4, &|_| {
                total.fetch_add(1, Ordering::Relaxed);
            });
        }
        assert_eq!(total.load(Ordering::Relaxed), 1600);
    }

    #[test]
    fn a_panicking_task_is_reported_to_the_caller() {
        let pool = ThreadPool::new(2);
        let r = catch_unwind(AssertUnwindSafe(|| {
            pool.run(64, &|i| {
                if i == 63 {
                    panic!("boom");
                }
            })
        }));
        assert!(r.is_err());
        // The pool still works afterwards.
        let n = AtomicUsize::new(0);
        pool.run(10, &|_| {
            n.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(n.load(Ordering::Relaxed), 10);
    }
}
