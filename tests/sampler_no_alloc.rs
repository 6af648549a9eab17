//! Checks that a warmed-up `Sampler` allocates nothing per call, with a
//! global allocator that counts allocations made by the current thread; and
//! that a wgpu sampler step creates no GPU object (buffer, bind group,
//! pipeline, shader module, device memory), read from wgpu's own resource
//! counters, while its host allocations per step (wgpu's command encoding)
//! stay a fixed few dozen whatever the batch size.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use inferd::sampler::gpu::{AdapterKind, GpuContext, GpuError, GpuSampler};
use inferd::sampler::{CheckedParams, SampleRequest, Sampler, SamplingParams};

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

/// Host allocations of each of `steps` warm GPU steps over `rows` rows.
fn gpu_step_allocations(
    gpu: &mut GpuSampler,
    logits: &[f32],
    params: &[CheckedParams],
    history: &[u32],
    rows: usize,
    steps: u64,
) -> Vec<usize> {
    let mut out = Vec::with_capacity(rows);
    let mut requests: Vec<SampleRequest<'_>> = Vec::with_capacity(rows);
    let mut per_step = Vec::with_capacity(steps as usize);
    for step in 0..steps + 3 {
        requests.clear();
        for row in 0..rows {
            requests.push(SampleRequest {
                mask: None,
                logits,
                params: &params[row % params.len()],
                history,
                position: step * 64 + row as u64,
                top_logprobs: 0,
            });
        }
        let before = allocations();
        gpu.sample_batch(&requests, &mut out);
        let after = allocations();
        assert!(out.iter().all(Result::is_ok), "{out:?}");
        // The first steps warm wgpu's own pools.
        if step >= 3 {
            per_step.push(after - before);
        }
    }
    per_step
}

#[test]
fn a_warm_gpu_step_creates_no_gpu_objects_and_a_fixed_few_host_allocations() {
    let context = match GpuContext::open(AdapterKind::Any) {
        Ok(context) => context,
        Err(GpuError::NoAdapter { seen }) => {
            let required = std::env::var("INFERD_REQUIRE_WGPU").is_ok_and(|v| v == "1");
            assert!(!required, "INFERD_REQUIRE_WGPU=1 but no wgpu adapter{seen}");
            eprintln!("\n!!! SKIPPING the wgpu allocation check: no wgpu adapter{seen}\n");
            return;
        }
        Err(other) => panic!("wgpu adapter present but unusable: {other}"),
    };
    let params = [
        SamplingParams::greedy(),
        SamplingParams {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.9,
            min_p: 0.05,
            repetition_penalty: 1.2,
            presence_penalty: 0.3,
            penalty_last_n: 64,
            logit_bias: vec![(3, 2.0)],
            seed: 5,
            ..SamplingParams::greedy()
        },
    ];
    let history: Vec<u32> = (0..300u32).map(|i| (i * 31) % 4096).collect();
    let mut seen = Vec::new();
    for (vocab, rows) in [(4096usize, 1usize), (4096, 8), (49_152, 32)] {
        let logits: Vec<f32> = (0..vocab)
            .map(|i| ((i * 7919) % 1000) as f32 / 100.0)
            .collect();
        let mut gpu =
            GpuSampler::new(std::sync::Arc::clone(&context), vocab, 32, 512).expect("buffers");
        let checked: Vec<CheckedParams> = params
            .iter()
            .map(|p| p.clone().checked(vocab).expect("valid"))
            .collect();
        // Warm up, then count GPU objects and memory around 50 more steps.
        gpu_step_allocations(&mut gpu, &logits, &checked, &history, rows, 2);
        let objects_before = context.resource_counts();
        let per_step = gpu_step_allocations(&mut gpu, &logits, &checked, &history, rows, 50);
        let objects_after = context.resource_counts();
        assert_eq!(
            objects_before, objects_after,
            "vocab {vocab}, {rows} rows: GPU objects changed over 50 steps"
        );
        // wgpu's own queue upkeep now and then makes a step allocate one
        // or two fewer or more; anything per row or per token would show as
        // a count that grows with the steps or the rows.
        let (least, most) = (
            per_step.iter().min().copied().unwrap_or(0),
            per_step.iter().max().copied().unwrap_or(0),
        );
        assert!(
            most - least <= 4,
            "vocab {vocab}, {rows} rows: {per_step:?}"
        );
        let usual = mode(&per_step);
        eprintln!(
            "vocab {vocab}, {rows} rows: {usual} host allocations per step (range {least}..={most}), GPU objects {objects_after:?}"
        );
        seen.push(usual);
    }
    // The batch size does not change the count (the first two runs share
    // a vocabulary): nothing per row or per token is allocated; what remains
    // is wgpu's command encoding, a fixed few dozen small allocations.
    assert_eq!(seen[0], seen[1], "{seen:?}");
    assert!(seen.iter().all(|&n| n <= 128), "{seen:?}");
    assert!(
        objects_are_counted(&context),
        "wgpu's counters read zero: built without `counters`?"
    );
}

/// The most frequent value (the smallest of equally frequent ones).
fn mode(values: &[usize]) -> usize {
    let mut sorted = values.to_vec();
    sorted.sort_unstable();
    let mut best = (0, 0);
    for run in sorted.chunk_by(|a, b| a == b) {
        if run.len() > best.1 {
            best = (run[0], run.len());
        }
    }
    best.0
}

fn objects_are_counted(context: &GpuContext) -> bool {
    let counts = context.resource_counts();
    counts.buffers > 0 && counts.compute_pipelines > 0 && counts.buffer_memory > 0
}
