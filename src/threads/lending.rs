//! Cores lent between the runtime's workers.
//!
//! Each runtime worker owns its sessions and runs their steps on its own
//! pinned thread; with one busy session and the other workers idle, that
//! step would use one core of many. A [`CoreGroup`] lets a worker that is
//! waiting for its own work take tasks of another member's open parallel
//! region, and give the core back between two tasks as soon as its own work
//! arrives. The owner never waits for a member to come: a region runs to the
//! end on the owner alone if nobody joins.
//!
//! The split of work never depends on who joins (callers split for
//! [`CoreGroup::size`] threads and each output is computed by exactly one
//! task), so lending changes timing, never results.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use super::{Helpers, Region, SpinWait, ThreadPool, SPIN_BEFORE_PARK};

/// How a member blocked on its own channel is woken to help (for a runtime
/// worker, a message on its wake channel).
pub type Wake = Box<dyn Fn() + Send + Sync>;

/// The members that lend each other their threads, one region each.
pub struct CoreGroup {
    members: Vec<Member>,
    /// Bumped whenever a member opens a region: what idle members watch.
    opened: AtomicU64,
}

struct Member {
    region: Region,
    /// The member is blocked waiting for its own work: an owner that opens a
    /// region wakes it so that it can help.
    blocked: AtomicBool,
    wake: Wake,
}

impl std::fmt::Debug for CoreGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CoreGroup")
            .field("members", &self.members.len())
            .finish()
    }
}

impl CoreGroup {
    /// A group with one member per waker.
    pub fn new(wakers: Vec<Wake>) -> Arc<Self> {
        Arc::new(CoreGroup {
            members: wakers
                .into_iter()
                .map(|wake| Member {
                    region: Region::new(),
                    blocked: AtomicBool::new(false),
                    wake,
                })
                .collect(),
            opened: AtomicU64::new(0),
        })
    }

    /// Members in the group: the most threads one region can have.
    pub fn size(&self) -> usize {
        self.members.len()
    }

    /// Member `member`'s compute pool: its regions are open to the others.
    /// Each member must use only its own pool, from one thread.
    ///
    /// # Panics
    /// If `member` is not below [`size`](Self::size).
    pub fn pool(self: &Arc<Self>, member: usize) -> ThreadPool {
        assert!(member < self.size(), "member {member} of {}", self.size());
        ThreadPool {
            helpers: Helpers::Lent {
                group: Arc::clone(self),
                member,
            },
        }
    }

    pub(super) fn run(&self, member: usize, n_tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        self.members[member].region.run(n_tasks, f, || {
            self.opened.fetch_add(1, Ordering::SeqCst);
            for (j, other) in self.members.iter().enumerate() {
                if j != member && other.blocked.load(Ordering::SeqCst) {
                    (other.wake)();
                }
            }
        });
    }

    /// Run by member `me` while it waits for its own work: takes tasks of
    /// the other members' open regions until `ready()` says its own work has
    /// come (checked between tasks), `until` passes, or no region has had a
    /// task for it for a spin period.
    pub fn help(&self, me: usize, until: Instant, ready: &dyn Fn() -> bool) {
        let mut last_task = Instant::now();
        let mut scanned = None;
        let mut spins = 0u32;
        let mut wait = SpinWait::new();
        loop {
            if ready() {
                return;
            }
            let opened = self.opened.load(Ordering::SeqCst);
            if scanned != Some(opened) {
                scanned = Some(opened);
                for (j, other) in self.members.iter().enumerate() {
                    let region = &other.region;
                    let epoch = region.epoch.load(Ordering::SeqCst);
                    if j != me && region.has_untaken_tasks() && region.join(epoch, ready) {
                        last_task = Instant::now();
                        wait = SpinWait::new();
                    }
                }
            }
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(256) {
                let now = Instant::now();
                if now >= until || now.duration_since(last_task) > SPIN_BEFORE_PARK {
                    return;
                }
            }
            wait.pause();
        }
    }

    /// Member `me` blocks in `wait` (for its own work, with a timeout),
    /// marked so that an owner opening a region wakes it. Returns `None`
    /// without waiting when a region with tasks for it is open already.
    pub fn block<R>(&self, me: usize, wait: impl FnOnce() -> R) -> Option<R> {
        let member = &self.members[me];
        // SeqCst pairs this store and the check below with the owner's
        // opening store and its read of `blocked`: either the owner sees the
        // flag and wakes us, or we see its region here.
        member.blocked.store(true, Ordering::SeqCst);
        let open = self
            .members
            .iter()
            .enumerate()
            .any(|(j, other)| j != me && other.region.has_untaken_tasks());
        let waited = (!open).then(wait);
        member.blocked.store(false, Ordering::SeqCst);
        waited
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::sync::mpsc;
    use std::time::Duration;

    fn no_wakers(n: usize) -> Vec<Wake> {
        (0..n).map(|_| Box::new(|| {}) as Wake).collect()
    }

    #[test]
    fn a_member_alone_runs_every_task_once() {
        let group = CoreGroup::new(no_wakers(3));
        let pool = group.pool(1);
        assert_eq!(pool.threads(), 3);
        super::super::tests::assert_every_task_runs_once(&pool);
    }

    /// A helping member takes part of an owner's tasks, and every task still
    /// runs exactly once.
    #[test]
    fn an_idle_member_takes_tasks_of_another() {
        let group = CoreGroup::new(no_wakers(2));
        let stop = Arc::new(AtomicBool::new(false));
        let helper = {
            let (group, stop) = (Arc::clone(&group), Arc::clone(&stop));
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let far = Instant::now() + Duration::from_secs(60);
                    group.help(1, far, &|| stop.load(Ordering::Relaxed));
                }
            })
        };
        let pool = group.pool(0);
        let owner = std::thread::current().id();
        let by_helper = AtomicUsize::new(0);
        let mut total = 0;
        for _ in 0..2000 {
            let hits: Vec<AtomicUsize> = (0..16).map(|_| AtomicUsize::new(0)).collect();
            pool.run(16, &|i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
                if std::thread::current().id() != owner {
                    by_helper.fetch_add(1, Ordering::Relaxed);
                }
                let busy = Instant::now();
                while busy.elapsed() < Duration::from_micros(20) {
                    std::hint::spin_loop();
                }
            });
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
            total += 16;
            if by_helper.load(Ordering::Relaxed) > 0 && total >= 1600 {
                break;
            }
        }
        stop.store(true, Ordering::Relaxed);
        helper.join().unwrap();
        assert!(
            by_helper.load(Ordering::Relaxed) > 0,
            "the idle member never took a task"
        );
    }

    /// A member whose own work arrives leaves the region between tasks; the
    /// owner finishes the rest.
    #[test]
    fn a_helper_leaves_when_its_own_work_arrives() {
        let group = CoreGroup::new(no_wakers(2));
        let own_work = Arc::new(AtomicBool::new(false));
        let (started_tx, started_rx) = mpsc::channel();
        let helper = {
            let (group, own_work) = (Arc::clone(&group), Arc::clone(&own_work));
            std::thread::spawn(move || {
                started_tx.send(()).unwrap();
                let far = Instant::now() + Duration::from_secs(60);
                group.help(1, far, &|| own_work.load(Ordering::Relaxed));
            })
        };
        started_rx.recv().unwrap();
        let pool = group.pool(0);
        let done = AtomicUsize::new(0);
        pool.run(64, &|i| {
            if i == 8 {
                own_work.store(true, Ordering::Relaxed);
            }
            std::thread::sleep(Duration::from_micros(200));
            done.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(done.load(Ordering::Relaxed), 64);
        helper.join().unwrap();
    }

    /// A blocked member is woken when another opens a region, and does not
    /// block at all while a region with untaken tasks is open.
    #[test]
    fn a_blocked_member_is_woken_by_a_new_region() {
        let (wake_tx, wake_rx) = mpsc::sync_channel::<()>(1);
        let wakers: Vec<Wake> = vec![
            Box::new(|| {}),
            Box::new(move || {
                let _ = wake_tx.try_send(());
            }),
        ];
        let group = CoreGroup::new(wakers);
        let blocked = {
            let group = Arc::clone(&group);
            std::thread::spawn(move || {
                group.block(1, || wake_rx.recv_timeout(Duration::from_secs(60)).is_ok())
            })
        };
        while !group.members[1].blocked.load(Ordering::SeqCst) {
            std::thread::yield_now();
        }
        group.pool(0).run(4, &|_| {});
        assert_eq!(blocked.join().unwrap(), Some(true));
    }

    #[test]
    fn a_panicking_task_reaches_the_owner_only() {
        let group = CoreGroup::new(no_wakers(2));
        let pool = group.pool(0);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            pool.run(8, &|i| {
                if i == 5 {
                    panic!("boom");
                }
            })
        }));
        assert!(r.is_err());
        let n = AtomicUsize::new(0);
        pool.run(8, &|_| {
            n.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(n.load(Ordering::Relaxed), 8);
    }
}
