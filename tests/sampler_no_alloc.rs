//! Checks that a warmed-up `Sampler` allocates nothing per call, with a
//! global allocator that counts allocations made by the current thread.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use inferd::sampler::{Sampler, SamplingParams};

struct CountingAllocator;

thread_local! {
    static ALLOCATIONS: Cell<usize> = const { Cell::new(0) };
}

// SAFETY: every call is forwarded unchanged to the system allocator; the
// thread-local counter is a `const`-initialised `Cell`, which never
// allocates, so counting cannot recurse into the allocator.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let _ = ALLOCATIONS.try_with(|count| count.set(count.get() + 1));
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System.alloc` with this `layout`.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let _ = ALLOCATIONS.try_with(|count| count.set(count.get() + 1));
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: CountingAllocator = CountingAllocator;

fn allocations() -> usize {
    ALLOCATIONS.with(Cell::get)
}

#[test]
fn a_warm_sampler_does_not_allocate() {
    const VOCAB: usize = 4096;
    let logits: Vec<f32> = (0..VOCAB)
        .map(|i| ((i * 7919) % 1000) as f32 / 100.0)
        .collect();
    let history: Vec<u32> = (0..300u32).map(|i| (i * 31) % VOCAB as u32).collect();
    let full_chain = SamplingParams {
        temperature: 0.8,
        top_k: 40,
        top_p: 0.9,
        min_p: 0.05,
        repetition_penalty: 1.2,
        presence_penalty: 0.3,
        frequency_penalty: 0.1,
        penalty_last_n: 64,
        logit_bias: vec![(3, 2.0)],
        seed: 5,
    };
    let nucleus_only = SamplingParams {
        temperature: 1.0,
        top_p: 0.99,
        ..SamplingParams::greedy()
    };
    let penalised_greedy = SamplingParams {
        repetition_penalty: 1.5,
        ..SamplingParams::greedy()
    };
    let all = [
        full_chain,
        nucleus_only,
        penalised_greedy,
        SamplingParams::greedy(),
    ];

    // The counter must see an allocation, or the check below proves nothing.
    let probe_before = allocations();
    let probe = std::hint::black_box(vec![1u8; 64]);
    assert!(allocations() > probe_before && probe.len() == 64);

    let mut sampler = Sampler::new();
    for params in &all {
        sampler.sample(&logits, params, &history, 0).unwrap();
    }
    let before = allocations();
    let mut tokens = 0u64;
    for position in 1..200u64 {
        for params in &all {
            tokens += u64::from(sampler.sample(&logits, params, &history, position).unwrap());
        }
    }
    let after = allocations();
    assert!(tokens > 0);
    assert_eq!(
        after - before,
        0,
        "{} allocations in 796 warm calls",
        after - before
    );
}
