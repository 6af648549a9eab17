//! A small fork-join thread pool for the forward pass.
//!
//! A decode step runs a few hundred short parallel regions (one per matrix
//! multiply or attention block), each lasting tens of microseconds, so the
//! hand-off must cost far less than that: workers spin on an epoch counter
//! for a while before parking, and the calling thread takes tasks too. A
//! wait that lasts past a few tens of microseconds yields its core between
//! looks ([`SpinWait`]), so that more threads than cores slow a pass down
//! rather than stall it for whole time slices.
//!
//! A pool need not own threads: a runtime worker's pool is a member of a
//! [`CoreGroup`], whose idle members take its tasks (`lending.rs`).
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

mod lending;

pub use lending::{CoreGroup, Wake};

/// How long an idle worker spins before it parks. Long enough to bridge the
/// gap between two parallel regions of one forward pass, short enough that an
/// idle server does not burn a core.
const SPIN_BEFORE_PARK: Duration = Duration::from_millis(2);

/// How long a wait spins before it lets other threads on its core run
/// between looks. A wait that lasts longer is most likely waiting for a
/// thread its core's scheduler has put aside (more threads than cores, or
/// another process on the core): pure spinning would hold that thread off
/// for the rest of the time slice.
const SPIN_BEFORE_YIELD: Duration = Duration::from_micros(50);

/// A spinning wait that yields the core between looks once it has lasted
/// [`SPIN_BEFORE_YIELD`]. Yielding costs about a system call when nothing
/// else wants the core, so a wait stays about as quick to notice. Not
/// `crossbeam_utils::Backoff`: it yields after a count of pauses (a few
/// microseconds, and a different time on each CPU), inside the tail of an
/// ordinary region; this threshold is a time, past those tails.
pub(crate) struct SpinWait {
    spins: u32,
    started: Option<Instant>,
    yielding: bool,
}

impl SpinWait {
    pub(crate) fn new() -> SpinWait {
        SpinWait {
            spins: 0,
            started: None,
            yielding: false,
        }
    }

    /// One pause between two looks.
    pub(crate) fn pause(&mut self) {
        if self.yielding {
            std::thread::yield_now();
            return;
        }
        self.spins = self.spins.wrapping_add(1);
        // Short waits, the common case, never read the clock.
        if self.spins.is_multiple_of(64) {
            let started = *self.started.get_or_insert_with(Instant::now);
            self.yielding = started.elapsed() > SPIN_BEFORE_YIELD;
        }
        std::hint::spin_loop();
    }
}

type Job = *const (dyn Fn(usize) + Sync);

/// One parallel region at a time: its task function and counters, and the
/// protocol by which an owner publishes it and other threads join it. The
/// pool's own threads join their pool's region; a lending group's idle
/// members join each other's (see [`lending`]).
struct Region {
    /// Bumped once per region; joiners compare it with the one they saw.
    epoch: AtomicU64,
    /// The current region's task function; valid while `closed` is false.
    job: UnsafeCell<Option<Job>>,
    n_tasks: AtomicUsize,
    next_task: AtomicUsize,
    /// Tasks finished in the current region.
    done_tasks: AtomicUsize,
    /// Threads that joined the current region and have not left it.
    active: AtomicUsize,
    /// Set by the owner once every task is done: no thread may join after.
    closed: AtomicBool,
    panicked: AtomicBool,
}

// SAFETY: `job` is written only by the owner in `Region::run`, while no
// thread is joined (before publishing a region, or after closing it and
// seeing `active == 0`). A joiner dereferences it only after joining
// (incrementing `active`, then seeing `closed == false` for the epoch it
// observed); the SeqCst pairing of `closed`/`active` makes "owner saw no
// joiner" and "joiner saw the region open" mutually exclusive.
unsafe impl Sync for Region {}
// SAFETY: the raw job pointer is only dereferenced under the protocol above.
unsafe impl Send for Region {}

impl Region {
    fn new() -> Self {
        Region {
            epoch: AtomicU64::new(0),
            job: UnsafeCell::new(None),
            n_tasks: AtomicUsize::new(0),
            next_task: AtomicUsize::new(0),
            done_tasks: AtomicUsize::new(0),
            active: AtomicUsize::new(0),
            closed: AtomicBool::new(true),
            panicked: AtomicBool::new(false),
        }
    }

    /// The owner's side: publishes `f(0..n_tasks)`, calls `announce` (to wake
    /// whoever may join), takes tasks itself, and returns when all are done
    /// and every joiner has left. A panic in a task is re-raised here.
    fn run(&self, n_tasks: usize, f: &(dyn Fn(usize) + Sync), announce: impl FnOnce()) {
        // SAFETY: the lifetime is erased only for the duration of this call:
        // the region is closed and every joiner has left before we return.
        let job: Job = unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync), Job>(f) };
        // SAFETY: the previous region is closed with no thread joined, so
        // nobody reads `job` concurrently.
        unsafe { *self.job.get() = Some(job) };
        self.n_tasks.store(n_tasks, Ordering::Relaxed);
        self.next_task.store(0, Ordering::Relaxed);
        self.done_tasks.store(0, Ordering::Relaxed);
        self.closed.store(false, Ordering::SeqCst);
        self.epoch.fetch_add(1, Ordering::SeqCst);
        announce();
        self.take_tasks(f, &|| false);
        let mut wait = SpinWait::new();
        while self.done_tasks.load(Ordering::Acquire) != n_tasks {
            wait.pause();
        }
        self.closed.store(true, Ordering::SeqCst);
        while self.active.load(Ordering::SeqCst) != 0 {
            wait.pause();
        }
        // SAFETY: closed, and no thread is joined.
        unsafe { *self.job.get() = None };
        if self.panicked.swap(false, Ordering::AcqRel) {
            panic!("a compute task panicked");
        }
    }

    /// Whether a region is open with tasks nobody has taken yet.
    fn has_untaken_tasks(&self) -> bool {
        !self.closed.load(Ordering::SeqCst)
            && self.next_task.load(Ordering::Relaxed) < self.n_tasks.load(Ordering::Relaxed)
    }

    /// A joiner's side: if the region published at epoch `seen` is still
    /// open, takes its tasks until none is left or `stop()` says so.
    /// Returns whether it joined.
    fn join(&self, seen: u64, stop: &dyn Fn() -> bool) -> bool {
        self.active.fetch_add(1, Ordering::SeqCst);
        let open = !self.closed.load(Ordering::SeqCst) && self.epoch.load(Ordering::SeqCst) == seen;
        if open {
            // SAFETY: joined while the region we observed is open: the owner
            // keeps `job` and the closure alive until we leave.
            if let Some(job) = unsafe { *self.job.get() } {
                // SAFETY: as above.
                self.take_tasks(unsafe { &*job }, stop);
            }
        }
        self.active.fetch_sub(1, Ordering::SeqCst);
        open
    }

    /// Takes and runs tasks until none is left or `stop()` (checked between
    /// tasks). A panicking task is recorded and still counted as done, so
    /// the region always completes.
    fn take_tasks(&self, f: &(dyn Fn(usize) + Sync), stop: &dyn Fn() -> bool) {
        let n = self.n_tasks.load(Ordering::Relaxed);
        loop {
            if stop() {
                break;
            }
            let i = self.next_task.fetch_add(1, Ordering::Relaxed);
            if i >= n {
                break;
            }
            if catch_unwind(AssertUnwindSafe(|| f(i))).is_err() {
                self.panicked.store(true, Ordering::Release);
            }
            self.done_tasks.fetch_add(1, Ordering::Release);
        }
    }
}

/// A pool's own threads and the region they serve.
struct PoolState {
    region: Region,
    shutdown: AtomicBool,
    sleeping: Vec<AtomicBool>,
}

/// Who runs a pool's regions besides the caller.
enum Helpers {
    /// The pool's own threads.
    Own {
        shared: Arc<PoolState>,
        workers: Vec<JoinHandle<()>>,
    },
    /// The idle members of a lending group (this pool is member `member`).
    Lent {
        group: Arc<CoreGroup>,
        member: usize,
    },
}

/// A fixed set of worker threads plus the caller, or a member of a
/// [`CoreGroup`] whose idle members lend their threads.
pub struct ThreadPool {
    helpers: Helpers,
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
            region: Region::new(),
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
        Self {
            helpers: Helpers::Own { shared, workers },
        }
    }

    /// Threads that may take part in a region, the caller included: what
    /// callers split work for (a lent pool counts every member of its group,
    /// though only the idle ones join).
    pub fn threads(&self) -> usize {
        match &self.helpers {
            Helpers::Own { workers, .. } => workers.len() + 1,
            Helpers::Lent { group, .. } => group.size(),
        }
    }

    /// Runs `f(0..n_tasks)`, each index exactly once, spread over the pool,
    /// and returns when all are done. The caller works too and never waits
    /// for a thread that has not joined: a descheduled or busy helper only
    /// means less parallelism. A panic in a task is re-raised here.
    pub fn run(&self, n_tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        if n_tasks <= 1 || self.threads() <= 1 {
            (0..n_tasks).for_each(f);
            return;
        }
        match &self.helpers {
            Helpers::Own { shared, workers } => shared.region.run(n_tasks, f, || {
                for (i, sleeping) in shared.sleeping.iter().enumerate() {
                    if sleeping.load(Ordering::SeqCst) {
                        workers[i].thread().unpark();
                    }
                }
            }),
            Helpers::Lent { group, member } => group.run(*member, n_tasks, f),
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
        let Helpers::Own { shared, workers } = &mut self.helpers else {
            return;
        };
        shared.shutdown.store(true, Ordering::SeqCst);
        shared.region.epoch.fetch_add(1, Ordering::SeqCst);
        for w in workers.iter() {
            w.thread().unpark();
        }
        for w in workers.drain(..) {
            let _ = w.join();
        }
    }
}

fn worker_loop(s: &PoolState, index: usize) {
    let region = &s.region;
    // The pool starts at epoch 0; a region may be published before this
    // thread first runs, so the starting value must not be read here.
    let mut seen = 0;
    loop {
        let started = Instant::now();
        let mut spins = 0u32;
        let mut wait = SpinWait::new();
        loop {
            let now = region.epoch.load(Ordering::SeqCst);
            if now != seen {
                seen = now;
                break;
            }
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(1024) && started.elapsed() > SPIN_BEFORE_PARK {
                s.sleeping[index].store(true, Ordering::SeqCst);
                if region.epoch.load(Ordering::SeqCst) == seen {
                    std::thread::park_timeout(Duration::from_millis(100));
                }
                s.sleeping[index].store(false, Ordering::SeqCst);
            } else {
                wait.pause();
            }
        }
        if s.shutdown.load(Ordering::SeqCst) {
            return;
        }
        region.join(seen, &|| false);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs regions of several sizes on `pool`: every task index exactly
    /// once each time.
    pub(super) fn assert_every_task_runs_once(pool: &ThreadPool) {
        for n in [0, 1, 2, 7, 100] {
            let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            pool.run(n, &|i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
        }
    }

    #[test]
    fn every_task_runs_exactly_once() {
        for threads in [1, 2, 3] {
            assert_every_task_runs_once(&ThreadPool::new(threads));
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
