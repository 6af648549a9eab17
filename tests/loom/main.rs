//! Model-checked tests of the KV page allocator (and, at the end, of the
//! runtime's awaitable reply channels): loom runs every interleaving
//! (and every permitted reordering of the atomics) of a few threads
//! allocating, sharing and freeing over a handful of pages, and each test
//! asserts that no page is handed out twice, none is reused while a holder
//! still references it, and none is lost. The runtime's cross-worker
//! structures are checked in `runtime.rs`.
//!
//! Run with:
//!
//! ```text
//! RUSTFLAGS="--cfg loom" cargo test --release --test loom
//! ```
//!
//! Without `--cfg loom` this file compiles to nothing.

#![cfg(loom)]

mod runtime;

use std::collections::HashSet;

use inferd::kv::{KvError, PageAllocator};
use loom::cell::UnsafeCell;
use loom::sync::atomic::{AtomicUsize, Ordering};
use loom::sync::Arc;
use loom::thread;

/// Every page is either held by someone in `held` or still free, exactly
/// once, and the free count agrees. Drains the allocator to check it.
fn assert_conserved(allocator: &PageAllocator, held: &[u32], total: usize) {
    let mut seen = HashSet::new();
    for &page in held {
        assert!(seen.insert(page), "page {page} is held twice");
    }
    assert_eq!(
        allocator.free_count(),
        total - seen.len(),
        "free count disagrees with the pages held"
    );
    let rest = match allocator.alloc_many(allocator.free_count()) {
        Ok(rest) => rest,
        Err(err) => panic!("draining the free pages failed: {err}"),
    };
    for page in rest {
        assert!(seen.insert(page), "page {page} is both held and free");
    }
    assert_eq!(seen.len(), total, "pages were lost");
    assert_eq!(allocator.free_count(), 0);
}

fn alloc_one(allocator: &PageAllocator) -> u32 {
    match allocator.alloc() {
        Ok(page) => page,
        Err(err) => panic!("alloc failed with pages to spare: {err}"),
    }
}

fn free_one(allocator: &PageAllocator, page: u32) {
    if let Err(err) = allocator.free(page) {
        panic!("free of a held page failed: {err}");
    }
}

/// The interleaving the ABA tag exists for: one thread pops while another
/// pops twice and pushes the first page back.
fn pop_pop_push_race(allocator: PageAllocator) {
    let allocator = Arc::new(allocator);
    let racer = {
        let allocator = Arc::clone(&allocator);
        thread::spawn(move || alloc_one(&allocator))
    };
    let first = alloc_one(&allocator);
    let second = alloc_one(&allocator);
    free_one(&allocator, first);
    let racer_page = match racer.join() {
        Ok(page) => page,
        Err(_) => panic!("racing thread panicked"),
    };
    assert_conserved(&allocator, &[second, racer_page], 3);
}

#[test]
fn two_threads_allocating_and_freeing_never_share_or_lose_a_page() {
    loom::model(|| {
        let allocator = match PageAllocator::new(3) {
            Ok(allocator) => allocator,
            Err(err) => panic!("{err}"),
        };
        pop_pop_push_race(allocator);
    });
}

#[test]
fn concurrent_multi_page_reservations_are_all_or_nothing() {
    loom::model(|| {
        let allocator = Arc::new(PageAllocator::new(3).unwrap_or_else(|err| panic!("{err}")));
        let preheld = alloc_one(&allocator);
        let reserve_two = |allocator: &PageAllocator| match allocator.alloc_many(2) {
            Ok(pages) => pages,
            Err(KvError::Exhausted { wanted: 2, free }) => {
                assert!(free < 2, "refused with {free} pages free");
                Vec::new()
            }
            Err(err) => panic!("unexpected error: {err}"),
        };
        let other = {
            let allocator = Arc::clone(&allocator);
            thread::spawn(move || reserve_two(&allocator))
        };
        // Freeing one page while the other thread reserves: depending on the
        // interleaving either reservation may be refused, never both, and a
        // refusal takes nothing.
        free_one(&allocator, preheld);
        let mut held = reserve_two(&allocator);
        let other_pages = other.join().unwrap_or_else(|_| panic!("reserver panicked"));
        assert!(
            !held.is_empty() || !other_pages.is_empty(),
            "both reservations failed with 3 pages in play"
        );
        held.extend(other_pages);
        assert_conserved(&allocator, &held, 3);
    });
}

#[test]
fn three_threads_cycling_pages_conserve_them() {
    let mut builder = loom::model::Builder::new();
    // Three threads of CAS loops are a large space; two preemptions per
    // execution still cover every pairwise race on the stack head.
    builder.preemption_bound = Some(2);
    builder.check(|| {
        let allocator = Arc::new(PageAllocator::new(2).unwrap_or_else(|err| panic!("{err}")));
        let workers: Vec<_> = (0..3)
            .map(|_| {
                let allocator = Arc::clone(&allocator);
                thread::spawn(move || match allocator.alloc() {
                    Ok(page) => free_one(&allocator, page),
                    Err(KvError::Exhausted { wanted: 1, free: 0 }) => {}
                    Err(err) => panic!("unexpected error: {err}"),
                })
            })
            .collect();
        for worker in workers {
            worker.join().unwrap_or_else(|_| panic!("worker panicked"));
        }
        assert_conserved(&allocator, &[], 2);
    });
}

#[test]
fn page_contents_pass_cleanly_from_one_owner_to_the_next() {
    // Each page's memory is modelled by a loom cell; loom reports a data race
    // if a new owner's access is not ordered after the previous owner's,
    // which is what the release/acquire pairs on the stack head guarantee.
    loom::model(|| {
        let allocator = Arc::new(PageAllocator::new(1).unwrap_or_else(|err| panic!("{err}")));
        let contents = Arc::new([UnsafeCell::new(0usize)]);
        let workers: Vec<_> = (1..=2)
            .map(|id| {
                let allocator = Arc::clone(&allocator);
                let contents = Arc::clone(&contents);
                thread::spawn(move || {
                    let page = match allocator.alloc() {
                        Ok(page) => page,
                        Err(KvError::Exhausted { wanted: 1, free: 0 }) => return,
                        Err(err) => panic!("unexpected error: {err}"),
                    };
                    let cell = &contents[page as usize];
                    cell.with_mut(|value| {
                        // SAFETY: the allocator gave this thread the page,
                        // so no other thread touches its cell; loom checks
                        // exactly that.
                        unsafe { *value = id }
                    });
                    let read = cell.with(|value| {
                        // SAFETY: as above, the page is this thread's alone.
                        unsafe { *value }
                    });
                    assert_eq!(read, id);
                    free_one(&allocator, page);
                })
            })
            .collect();
        for worker in workers {
            worker.join().unwrap_or_else(|_| panic!("worker panicked"));
        }
        assert_conserved(&allocator, &[], 1);
    });
}

#[test]
fn a_shared_page_is_reused_only_after_every_holder_let_go() {
    // Two holders read a shared page (a forked session and its source)
    // and release it in either order while a third thread allocates: loom
    // reports a data race if the new owner's write to the page's cell is
    // not ordered after both holders' reads, and the page is handed out
    // again only once both references are gone.
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = Some(3);
    builder.check(|| {
        let allocator = Arc::new(PageAllocator::new(1).unwrap_or_else(|err| panic!("{err}")));
        let contents = Arc::new([UnsafeCell::new(0usize)]);
        let page = alloc_one(&allocator);
        contents[page as usize].with_mut(|value| {
            // SAFETY: the page was just handed to this thread alone.
            unsafe { *value = 7 }
        });
        if let Err(err) = allocator.share(page) {
            panic!("sharing a held page failed: {err}");
        }
        let read_and_release =
            move |allocator: &PageAllocator, contents: &[UnsafeCell<usize>; 1]| {
                let seen = contents[page as usize].with(|value| {
                    // SAFETY: this holder's reference keeps the page from being
                    // reused; holders only read it.
                    unsafe { *value }
                });
                assert_eq!(seen, 7, "a holder saw another owner's write");
                free_one(allocator, page);
            };
        let fork = {
            let (allocator, contents) = (Arc::clone(&allocator), Arc::clone(&contents));
            thread::spawn(move || read_and_release(&allocator, &contents))
        };
        let newcomer = {
            let (allocator, contents) = (Arc::clone(&allocator), Arc::clone(&contents));
            thread::spawn(move || match allocator.alloc() {
                Ok(page) => {
                    contents[page as usize].with_mut(|value| {
                        // SAFETY: the allocator handed the page over only
                        // after its last holder released it; loom checks
                        // that the releases are ordered before this write.
                        unsafe { *value = 9 }
                    });
                    free_one(&allocator, page);
                }
                Err(KvError::Exhausted { wanted: 1, free: 0 }) => {}
                Err(err) => panic!("unexpected error: {err}"),
            })
        };
        read_and_release(&allocator, &contents);
        fork.join().unwrap_or_else(|_| panic!("fork panicked"));
        newcomer
            .join()
            .unwrap_or_else(|_| panic!("newcomer panicked"));
        assert_conserved(&allocator, &[], 1);
    });
}

#[test]
fn holders_sharing_and_releasing_at_once_free_the_page_exactly_once() {
    // Each of two holders takes a further reference (a fork of a fork)
    // and then drops both of its own while the other does the same: the
    // counts race, and the page must come back exactly once, at the end.
    loom::model(|| {
        let allocator = Arc::new(PageAllocator::new(2).unwrap_or_else(|err| panic!("{err}")));
        let page = alloc_one(&allocator);
        if let Err(err) = allocator.share(page) {
            panic!("sharing a held page failed: {err}");
        }
        let fork_and_drop = move |allocator: &PageAllocator| {
            if let Err(err) = allocator.share(page) {
                panic!("sharing a held page failed: {err}");
            }
            free_one(allocator, page);
            free_one(allocator, page);
        };
        let other = {
            let allocator = Arc::clone(&allocator);
            thread::spawn(move || fork_and_drop(&allocator))
        };
        fork_and_drop(&allocator);
        other.join().unwrap_or_else(|_| panic!("holder panicked"));
        assert_conserved(&allocator, &[], 2);
    });
}

#[test]
fn pages_claimed_at_a_restart_come_back_once_their_restored_holders_let_go() {
    // A restart builds the allocator around pages two restored sessions
    // took back (page 1 held by both, page 3 by one): while they release
    // them, another worker allocates. A claimed page is handed out only
    // after every holder let go (each counts its release first, so a page
    // handed out early would show a count short), and every page ends up
    // free exactly once.
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = Some(3);
    builder.check(|| {
        let allocator = Arc::new(
            PageAllocator::with_references(&[0, 2, 0, 1]).unwrap_or_else(|err| panic!("{err}")),
        );
        let released = Arc::new([AtomicUsize::new(0), AtomicUsize::new(0)]);
        let release = |allocator: &PageAllocator, released: &[AtomicUsize; 2], page: u32| {
            released[usize::from(page == 3)].fetch_add(1, Ordering::Relaxed);
            free_one(allocator, page);
        };
        let restored = {
            let (allocator, released) = (Arc::clone(&allocator), Arc::clone(&released));
            thread::spawn(move || {
                release(&allocator, &released, 1);
                release(&allocator, &released, 3);
            })
        };
        let newcomer = {
            let (allocator, released) = (Arc::clone(&allocator), Arc::clone(&released));
            thread::spawn(move || {
                let mut pages = match allocator.alloc_many(2) {
                    Ok(pages) => pages,
                    Err(err) => panic!("two pages were free from the start: {err}"),
                };
                match allocator.alloc() {
                    Ok(page) => pages.push(page),
                    Err(KvError::Exhausted { .. }) => {}
                    Err(err) => panic!("unexpected error: {err}"),
                }
                for &page in &pages {
                    let holders = match page {
                        1 => released[0].load(Ordering::Relaxed),
                        3 => released[1].load(Ordering::Relaxed),
                        _ => continue,
                    };
                    let claimed = if page == 1 { 2 } else { 1 };
                    assert_eq!(holders, claimed, "page {page} handed out while held");
                }
                for page in pages {
                    free_one(&allocator, page);
                }
            })
        };
        release(&allocator, &released, 1);
        restored
            .join()
            .unwrap_or_else(|_| panic!("restored session panicked"));
        newcomer
            .join()
            .unwrap_or_else(|_| panic!("newcomer panicked"));
        assert_conserved(&allocator, &[], 4);
    });
}

#[test]
#[should_panic(expected = "page allocator corrupted")]
fn the_checker_finds_aba_when_the_tag_is_removed() {
    loom::model(|| {
        let allocator = PageAllocator::new_without_aba_tag(3).unwrap_or_else(|err| panic!("{err}"));
        pop_pop_push_race(allocator);
    });
}

// ---------------------------------------------------------------------------
// Reply channels (runtime::notify): a worker sends and drops its sender while
// a gRPC future polls the receiver. Loom's `block_on` fails the model if the
// future is left pending with no wake-up to come (a lost wake-up).

mod notify_channel {
    use std::future::poll_fn;

    use inferd::runtime::notify;
    use loom::thread;

    #[test]
    fn a_reply_then_the_disconnect_always_wake_the_awaiting_task() {
        loom::model(|| {
            let (tx, rx) = notify::channel::<u32>(1);
            let worker = thread::spawn(move || {
                let _ = tx.send(7);
                drop(tx);
            });
            let got = loom::future::block_on(async {
                let first = poll_fn(|cx| rx.poll_recv(cx)).await;
                let second = poll_fn(|cx| rx.poll_recv(cx)).await;
                (first, second)
            });
            worker.join().expect("worker thread");
            assert_eq!(got, (Some(7), None));
        });
    }

    #[test]
    fn a_sender_dropped_without_a_reply_wakes_the_task_with_the_disconnect() {
        // Two dropping threads and the poller make a large state space; a
        // preemption bound of 3 keeps the run short and still covers every
        // order of the two drops against register-then-check.
        let mut model = loom::model::Builder::new();
        model.preemption_bound = Some(3);
        model.check(|| {
            let (tx, rx) = notify::channel::<u32>(1);
            let clone = tx.clone();
            let a = thread::spawn(move || drop(tx));
            let b = thread::spawn(move || drop(clone));
            let got = loom::future::block_on(poll_fn(|cx| rx.poll_recv(cx)));
            a.join().expect("thread a");
            b.join().expect("thread b");
            assert_eq!(got, None);
        });
    }
}
