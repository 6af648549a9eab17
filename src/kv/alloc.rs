//! The lock-free page allocator shared by all worker threads: a Treiber stack
//! of free page indices with an ABA tag, a counting semaphore that makes
//! multi-page reservations all-or-nothing, and a reference count per page so
//! that sessions (forks, shared prefixes) can hold one page together.
//!
//! # Structure
//!
//! - `head` packs `(tag << 32) | index` into one `AtomicU64`. `index` is the
//!   top free page, or `NIL` when the stack is empty. `tag` is bumped by every
//!   successful update of `head`, so a `head` value is never seen twice in a
//!   short window: this defeats the ABA problem (a thread that read
//!   `head = A, next(A) = B`, stalled while `A` and `B` were popped and `A`
//!   pushed back, would otherwise install `B`, a page someone else now holds).
//!   The tag is 32 bits: a stalled thread would have to sleep through exactly
//!   2^32 updates for a stale compare-and-swap to succeed.
//! - `next[i]` is the link below page `i` while `i` is on the stack.
//! - `available` counts pages that may be reserved. A reservation first
//!   subtracts from it (failing with nothing changed when too few are left),
//!   then pops its pages, which must be there (see below). A free pushes the
//!   page first and only then adds to `available`.
//! - `refs[i]` counts the holders of page `i`: 0 while it is free, 1 when
//!   handed out, more once [`PageAllocator::share`] added holders. Only the
//!   release that takes it to 0 pushes the page, so a page is never free
//!   while referenced, and a release of a free page is an error instead of
//!   a corrupted list.
//!
//! # Memory orderings and why
//!
//! - Push: link store `Relaxed`, then `head` CAS `Release`. The release
//!   publishes both the link and everything the freeing thread wrote into the
//!   page to whoever pops it.
//! - Pop: `head` load and CAS `Acquire`. The acquire pairs with the pushing
//!   release (every later CAS on `head` is a read-modify-write, so it extends
//!   that release sequence), which makes the link read `Relaxed` safe: it sees
//!   the pusher's link, or a newer one written after a pop and re-push, in
//!   which case the tag has changed and the CAS fails.
//! - `available`: increments `Release`, reservation CAS `Acquire`. A thread
//!   holding a reservation has therefore synchronised with every free whose
//!   increment it consumed, so those pushes happen before its pops; counting
//!   pushes and pops in `head`'s modification order then shows the stack can
//!   never look empty to a thread holding an unfilled reservation. The loom
//!   tests check this.
//! - `refs`: a pop's 0 -> 1 is `Relaxed` (the `head` CAS already orders it
//!   after the push that freed the page). A share is `Relaxed`, as cloning
//!   an `Arc` is: the sharer holds a reference, so the count cannot reach 0
//!   meanwhile. A release is `AcqRel`: its release half publishes this
//!   holder's use of the page, and the acquire half of the release that
//!   reaches 0 (every decrement being a read-modify-write in one
//!   modification order) makes every other holder's use happen before the
//!   push, hence before any later owner's writes.

use crossbeam_utils::CachePadded;

use super::error::KvError;
use crate::sync::{AtomicU32, AtomicU64, AtomicUsize, Ordering};

/// The empty-stack marker in the index half of `head` and in links.
const NIL: u32 = u32::MAX;

/// Most pages one allocator can manage (`NIL` is not a page).
pub const MAX_PAGES: usize = (u32::MAX - 1) as usize;

fn pack(tag: u32, index: u32) -> u64 {
    (u64::from(tag) << 32) | u64::from(index)
}

fn unpack(word: u64) -> (u32, u32) {
    ((word >> 32) as u32, word as u32)
}

/// A lock-free free list of page indices `0..total`, shared by reference
/// between threads.
pub struct PageAllocator {
    head: CachePadded<AtomicU64>,
    available: CachePadded<AtomicUsize>,
    next: Box<[AtomicU32]>,
    refs: Box<[AtomicU32]>,
    /// How much each update bumps the ABA tag; only the loom tests set it to
    /// zero, to prove the model checker finds the bug the tag prevents.
    #[cfg(loom)]
    tag_step: u32,
}

impl PageAllocator {
    /// An allocator with pages `0..n_pages` all free. Pages are handed out
    /// lowest index first while nothing has been freed.
    pub fn new(n_pages: usize) -> Result<Self, KvError> {
        if n_pages > MAX_PAGES {
            return Err(KvError::InvalidConfig {
                reason: format!("{n_pages} pages is more than the allocator limit of {MAX_PAGES}"),
            });
        }
        let next: Box<[AtomicU32]> = (0..n_pages)
            .map(|i| {
                let below = if i + 1 < n_pages { (i + 1) as u32 } else { NIL };
                AtomicU32::new(below)
            })
            .collect();
        let refs: Box<[AtomicU32]> = (0..n_pages).map(|_| AtomicU32::new(0)).collect();
        let top = if n_pages == 0 { NIL } else { 0 };
        Ok(PageAllocator {
            head: CachePadded::new(AtomicU64::new(pack(0, top))),
            available: CachePadded::new(AtomicUsize::new(n_pages)),
            next,
            refs,
            #[cfg(loom)]
            tag_step: 1,
        })
    }

    /// An allocator over `refs.len()` pages where page `i` already has
    /// `refs[i]` holders (0: free): the pool a restart builds around the
    /// pages it took back from the page file. The free pages are handed out
    /// lowest index first.
    pub fn with_references(refs: &[u32]) -> Result<Self, KvError> {
        let n_pages = refs.len();
        if n_pages > MAX_PAGES {
            return Err(KvError::InvalidConfig {
                reason: format!("{n_pages} pages is more than the allocator limit of {MAX_PAGES}"),
            });
        }
        let free: Vec<u32> = (0..n_pages as u32)
            .filter(|&i| refs[i as usize] == 0)
            .collect();
        let mut links = vec![NIL; n_pages];
        for pair in free.windows(2) {
            links[pair[0] as usize] = pair[1];
        }
        Ok(PageAllocator {
            head: CachePadded::new(AtomicU64::new(pack(
                0,
                free.first().copied().unwrap_or(NIL),
            ))),
            available: CachePadded::new(AtomicUsize::new(free.len())),
            next: links.into_iter().map(AtomicU32::new).collect(),
            refs: refs.iter().map(|&n| AtomicU32::new(n)).collect(),
            #[cfg(loom)]
            tag_step: 1,
        })
    }

    /// A deliberately broken allocator whose ABA tag never changes. It exists
    /// only under `--cfg loom`, for the test that proves the checker bites.
    #[cfg(loom)]
    pub fn new_without_aba_tag(n_pages: usize) -> Result<Self, KvError> {
        let mut allocator = Self::new(n_pages)?;
        allocator.tag_step = 0;
        Ok(allocator)
    }

    #[cfg(loom)]
    fn tag_step(&self) -> u32 {
        self.tag_step
    }

    #[cfg(not(loom))]
    #[inline]
    fn tag_step(&self) -> u32 {
        1
    }

    /// How many pages the allocator manages in all.
    pub fn total(&self) -> usize {
        self.next.len()
    }

    /// Pages free right now. Exact when no other thread is allocating or
    /// freeing; otherwise a snapshot that may be stale by the time it is read.
    pub fn free_count(&self) -> usize {
        self.available.load(Ordering::Relaxed)
    }

    /// One page, or `Exhausted { wanted: 1, free: 0 }`.
    pub fn alloc(&self) -> Result<u32, KvError> {
        self.reserve(1)?;
        self.pop_reserved().inspect_err(|_| self.unreserve(1))
    }

    /// Exactly `n` pages, or none: on `Exhausted { wanted: n, free }` the
    /// allocator is unchanged.
    pub fn alloc_many(&self, n: usize) -> Result<Vec<u32>, KvError> {
        if n == 0 {
            return Ok(Vec::new());
        }
        self.reserve(n)?;
        let mut pages = Vec::with_capacity(n);
        for taken in 0..n {
            match self.pop_reserved() {
                Ok(page) => pages.push(page),
                Err(err) => {
                    // Hand back what this call holds so a bug elsewhere does
                    // not also leak pages here.
                    self.unreserve(n - taken);
                    for &page in &pages {
                        let _ = self.free(page);
                    }
                    return Err(err);
                }
            }
        }
        Ok(pages)
    }

    /// Gives up one reference to a page; the last one returns it to the free
    /// list. Fails, changing nothing, if the page does not exist or is
    /// already free.
    pub fn free(&self, page: u32) -> Result<(), KvError> {
        let count = self.count(page)?;
        let mut held = count.load(Ordering::Relaxed);
        loop {
            if held == 0 {
                return Err(KvError::DoubleFree { page });
            }
            match count.compare_exchange_weak(held, held - 1, Ordering::AcqRel, Ordering::Relaxed) {
                Ok(_) => break,
                Err(now) => held = now,
            }
        }
        if held == 1 {
            self.push(page);
            self.available.fetch_add(1, Ordering::Release);
        }
        Ok(())
    }

    /// Adds a reference to a page the caller holds (a fork, or a session
    /// mapping a shared prefix): the page stays allocated until every
    /// reference is freed. Fails, changing nothing, if the page does not
    /// exist, is free, or already has `u32::MAX` references.
    pub fn share(&self, page: u32) -> Result<(), KvError> {
        let count = self.count(page)?;
        let mut held = count.load(Ordering::Relaxed);
        loop {
            if held == 0 {
                return Err(KvError::ShareOfFreePage { page });
            }
            let more = held
                .checked_add(1)
                .ok_or(KvError::TooManyReferences { page })?;
            match count.compare_exchange_weak(held, more, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => return Ok(()),
                Err(now) => held = now,
            }
        }
    }

    /// How many references hold `page` right now (0: free). A snapshot, like
    /// [`PageAllocator::free_count`]; a page with one reference held by the
    /// caller is the caller's alone.
    pub fn references(&self, page: u32) -> Result<u32, KvError> {
        Ok(self.count(page)?.load(Ordering::Relaxed))
    }

    fn count(&self, page: u32) -> Result<&AtomicU32, KvError> {
        self.refs.get(page as usize).ok_or(KvError::PageOutOfRange {
            page,
            total: self.total(),
        })
    }

    /// Return several pages; every page is tried, and the first error (if
    /// any) is reported.
    pub fn free_many(&self, pages: &[u32]) -> Result<(), KvError> {
        let mut first_error = None;
        for &page in pages {
            if let Err(err) = self.free(page) {
                first_error.get_or_insert(err);
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// Take `n` pages off the `available` count, or report how many there are.
    fn reserve(&self, n: usize) -> Result<(), KvError> {
        let mut free = self.available.load(Ordering::Relaxed);
        loop {
            if free < n {
                return Err(KvError::Exhausted { wanted: n, free });
            }
            match self.available.compare_exchange_weak(
                free,
                free - n,
                Ordering::Acquire,
                Ordering::Relaxed,
            ) {
                Ok(_) => return Ok(()),
                Err(now) => free = now,
            }
        }
    }

    fn unreserve(&self, n: usize) {
        self.available.fetch_add(n, Ordering::Release);
    }

    /// Pop one page for a caller that already holds a reservation for it.
    fn pop_reserved(&self) -> Result<u32, KvError> {
        let mut head = self.head.load(Ordering::Acquire);
        loop {
            let (tag, top) = unpack(head);
            if top == NIL {
                return Err(KvError::AllocatorCorrupted {
                    detail: "free list empty under a reservation".to_string(),
                });
            }
            let link = self
                .next
                .get(top as usize)
                .ok_or_else(|| KvError::AllocatorCorrupted {
                    detail: format!("free list top {top} is not a page"),
                })?;
            // Possibly stale if `top` was popped and pushed again since
            // `head` was read; the tag then makes the CAS below fail.
            let below = link.load(Ordering::Relaxed);
            let new_head = pack(tag.wrapping_add(self.tag_step()), below);
            match self.head.compare_exchange_weak(
                head,
                new_head,
                Ordering::Acquire,
                Ordering::Acquire,
            ) {
                Ok(_) => break self.mark_in_use(top),
                Err(now) => head = now,
            }
        }
    }

    fn mark_in_use(&self, page: u32) -> Result<u32, KvError> {
        let taken = self.refs.get(page as usize).is_some_and(|count| {
            count
                .compare_exchange(0, 1, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        });
        if !taken {
            return Err(KvError::AllocatorCorrupted {
                detail: format!("page {page} came off the free list while in use"),
            });
        }
        Ok(page)
    }

    fn push(&self, page: u32) {
        let Some(link) = self.next.get(page as usize) else {
            return;
        };
        let mut head = self.head.load(Ordering::Relaxed);
        loop {
            let (tag, top) = unpack(head);
            link.store(top, Ordering::Relaxed);
            let new_head = pack(tag.wrapping_add(self.tag_step()), page);
            match self.head.compare_exchange_weak(
                head,
                new_head,
                Ordering::Release,
                Ordering::Relaxed,
            ) {
                Ok(_) => return,
                Err(now) => head = now,
            }
        }
    }
}

impl std::fmt::Debug for PageAllocator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PageAllocator")
            .field("total", &self.total())
            .field("free", &self.free_count())
            .finish()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use std::collections::HashSet;
    use std::sync::{Arc, Barrier};

    use super::*;

    #[test]
    fn pages_claimed_at_start_are_never_handed_out_until_every_holder_lets_go() {
        let a = PageAllocator::with_references(&[0, 2, 0, 1, 0]).unwrap();
        assert_eq!((a.total(), a.free_count()), (5, 3));
        assert_eq!(a.references(1).unwrap(), 2);
        let mut got = a.alloc_many(3).unwrap();
        got.sort_unstable();
        assert_eq!(got, vec![0, 2, 4]);
        assert!(matches!(a.alloc(), Err(KvError::Exhausted { .. })));
        a.free(1).unwrap();
        assert!(a.alloc().is_err(), "page 1 still has a holder");
        a.free(1).unwrap();
        a.free(3).unwrap();
        let mut back = a.alloc_many(2).unwrap();
        back.sort_unstable();
        assert_eq!(back, vec![1, 3]);
        assert!(matches!(
            a.free(3).and_then(|()| a.free(3)),
            Err(KvError::DoubleFree { page: 3 })
        ));
        let none = PageAllocator::with_references(&[1, 1]).unwrap();
        assert_eq!(none.free_count(), 0);
        assert!(none.alloc().is_err());
    }

    #[test]
    fn hands_out_every_page_once_then_reports_exhaustion() {
        let allocator = PageAllocator::new(4).unwrap();
        let pages: Vec<u32> = (0..4).map(|_| allocator.alloc().unwrap()).collect();
        assert_eq!(pages, vec![0, 1, 2, 3]);
        assert_eq!(allocator.free_count(), 0);
        match allocator.alloc() {
            Err(KvError::Exhausted { wanted: 1, free: 0 }) => {}
            other => panic!("expected exhaustion, got {other:?}"),
        }
    }

    #[test]
    fn freed_pages_come_back_last_in_first_out() {
        let allocator = PageAllocator::new(3).unwrap();
        let pages = allocator.alloc_many(3).unwrap();
        allocator.free(pages[0]).unwrap();
        allocator.free(pages[2]).unwrap();
        assert_eq!(allocator.free_count(), 2);
        assert_eq!(allocator.alloc().unwrap(), pages[2]);
        assert_eq!(allocator.alloc().unwrap(), pages[0]);
    }

    #[test]
    fn failed_alloc_many_changes_nothing() {
        let allocator = PageAllocator::new(5).unwrap();
        let held = allocator.alloc_many(3).unwrap();
        match allocator.alloc_many(3) {
            Err(KvError::Exhausted { wanted: 3, free: 2 }) => {}
            other => panic!("expected exhaustion, got {other:?}"),
        }
        assert_eq!(allocator.free_count(), 2);
        let rest = allocator.alloc_many(2).unwrap();
        let all: HashSet<u32> = held.iter().chain(&rest).copied().collect();
        assert_eq!(all, (0..5).collect());
    }

    #[test]
    fn double_free_and_foreign_pages_are_errors_that_change_nothing() {
        let allocator = PageAllocator::new(2).unwrap();
        let page = allocator.alloc().unwrap();
        allocator.free(page).unwrap();
        assert!(matches!(allocator.free(page), Err(KvError::DoubleFree { page: p }) if p == page));
        assert!(matches!(
            allocator.free(9),
            Err(KvError::PageOutOfRange { page: 9, total: 2 })
        ));
        assert_eq!(allocator.free_count(), 2);
        let mut all = allocator.alloc_many(2).unwrap();
        all.sort_unstable();
        assert_eq!(all, vec![0, 1]);
    }

    #[test]
    fn empty_allocator_and_zero_sized_requests() {
        let allocator = PageAllocator::new(0).unwrap();
        assert_eq!(allocator.alloc_many(0).unwrap(), Vec::<u32>::new());
        assert!(matches!(
            allocator.alloc(),
            Err(KvError::Exhausted { wanted: 1, free: 0 })
        ));
    }

    #[test]
    fn free_many_frees_all_and_reports_the_first_error() {
        let allocator = PageAllocator::new(3).unwrap();
        let pages = allocator.alloc_many(2).unwrap();
        let err = allocator.free_many(&[pages[0], 7, pages[1]]).unwrap_err();
        assert!(matches!(err, KvError::PageOutOfRange { page: 7, .. }));
        assert_eq!(allocator.free_count(), 3);
    }

    #[test]
    fn a_shared_page_is_free_only_after_its_last_reference() {
        let allocator = PageAllocator::new(2).unwrap();
        let page = allocator.alloc().unwrap();
        allocator.share(page).unwrap();
        allocator.share(page).unwrap();
        assert_eq!(allocator.references(page).unwrap(), 3);
        allocator.free(page).unwrap();
        allocator.free(page).unwrap();
        assert_eq!(allocator.free_count(), 1, "freed while still referenced");
        allocator.free(page).unwrap();
        assert_eq!(allocator.free_count(), 2);
        assert_eq!(allocator.references(page).unwrap(), 0);
        assert!(matches!(
            allocator.free(page),
            Err(KvError::DoubleFree { .. })
        ));
    }

    #[test]
    fn sharing_a_free_or_foreign_page_is_an_error_that_changes_nothing() {
        let allocator = PageAllocator::new(2).unwrap();
        assert!(matches!(
            allocator.share(1),
            Err(KvError::ShareOfFreePage { page: 1 })
        ));
        assert!(matches!(
            allocator.share(5),
            Err(KvError::PageOutOfRange { page: 5, total: 2 })
        ));
        assert_eq!(allocator.free_count(), 2);
        assert_eq!(allocator.references(1).unwrap(), 0);
        let mut all = allocator.alloc_many(2).unwrap();
        all.sort_unstable();
        assert_eq!(all, vec![0, 1]);
    }

    #[test]
    fn threads_sharing_and_releasing_free_each_page_once() {
        const PAGES: u32 = 16;
        const THREADS: usize = 4;
        let allocator = Arc::new(PageAllocator::new(PAGES as usize).unwrap());
        let pages = allocator.alloc_many(PAGES as usize).unwrap();
        // Every thread takes a reference to every page, then the original
        // holder lets go: the threads' releases race to be the last.
        for &page in &pages {
            for _ in 0..THREADS {
                allocator.share(page).unwrap();
            }
            allocator.free(page).unwrap();
        }
        let barrier = Arc::new(Barrier::new(THREADS));
        let workers: Vec<_> = (0..THREADS)
            .map(|_| {
                let (allocator, barrier, pages) =
                    (Arc::clone(&allocator), Arc::clone(&barrier), pages.clone());
                std::thread::spawn(move || {
                    barrier.wait();
                    for page in pages {
                        allocator.share(page).unwrap();
                        allocator.free(page).unwrap();
                        allocator.free(page).unwrap();
                    }
                })
            })
            .collect();
        for worker in workers {
            worker.join().unwrap();
        }
        assert_eq!(allocator.free_count(), PAGES as usize);
        let mut all = allocator.alloc_many(PAGES as usize).unwrap();
        all.sort_unstable();
        assert_eq!(all, (0..PAGES).collect::<Vec<_>>());
    }

    #[test]
    fn threads_hammering_alloc_and_free_conserve_pages() {
        const PAGES: usize = 64;
        const THREADS: usize = 4;
        const ROUNDS: usize = 20_000;
        let allocator = Arc::new(PageAllocator::new(PAGES).unwrap());
        let barrier = Arc::new(Barrier::new(THREADS));
        let workers: Vec<_> = (0..THREADS)
            .map(|t| {
                let allocator = Arc::clone(&allocator);
                let barrier = Arc::clone(&barrier);
                std::thread::spawn(move || {
                    barrier.wait();
                    let mut held: Vec<u32> = Vec::new();
                    let mut exhausted = 0usize;
                    for round in 0..ROUNDS {
                        let want = 1 + (round + t) % 5;
                        match allocator.alloc_many(want) {
                            Ok(pages) => held.extend(pages),
                            Err(KvError::Exhausted { wanted, free }) => {
                                assert_eq!(wanted, want);
                                assert!(free < want);
                                exhausted += 1;
                            }
                            Err(other) => panic!("unexpected error {other}"),
                        }
                        if held.len() > 6 || round % 3 == 0 {
                            let keep = held.len() / 2;
                            allocator.free_many(&held[keep..]).unwrap();
                            held.truncate(keep);
                        }
                    }
                    (held, exhausted)
                })
            })
            .collect();
        let mut seen = HashSet::new();
        for worker in workers {
            let (held, _) = worker.join().unwrap();
            for page in held {
                assert!(seen.insert(page), "page {page} held twice");
            }
        }
        let remaining = allocator.alloc_many(allocator.free_count()).unwrap();
        for page in remaining {
            assert!(seen.insert(page), "page {page} both free and held");
        }
        assert_eq!(seen.len(), PAGES, "pages were lost");
        assert_eq!(allocator.free_count(), 0);
    }
}
