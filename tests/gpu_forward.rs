//! The whole forward pass on a wgpu device (Mesa's lavapipe in CI) against
//! the CPU backend on small synthetic models: logits close to the CPU's,
//! and on the device bit-identical however a history is fed (one call,
//! token by token, in chunks, beside other sessions); a shard's layers on
//! the device close to the CPU's, and the same bits however the layers are
//! split into shards or the rows into steps.
//!
//! Without any wgpu adapter these tests say so loudly and pass, unless
//! `INFERD_REQUIRE_WGPU=1` (set by `scripts/test`), when they fail.

mod support;

use std::sync::{Arc, OnceLock};

use inferd::gguf::GgufFile;
use inferd::gpu::{
    AdapterKind, DeviceKv, GpuDevice, GpuError, GpuFeed, GpuForward, GpuLayerFeed, GpuModel,
    StepCapacity,
};
use inferd::kv::{KvPool, KvPoolConfig, SessionKv};
use inferd::model::{LayerFeed, LogitsWanted, Model, Scratch, Sequence};
use inferd::quant::GgmlType;
use inferd::threads::ThreadPool;

fn device() -> Option<Arc<GpuDevice>> {
    static DEVICE: OnceLock<Option<Arc<GpuDevice>>> = OnceLock::new();
    DEVICE
        .get_or_init(|| match GpuDevice::open(AdapterKind::Any) {
            Ok(device) => Some(device),
            Err(GpuError::NoAdapter { seen }) => {
                let required = std::env::var("INFERD_REQUIRE_WGPU").is_ok_and(|v| v == "1");
                assert!(!required, "INFERD_REQUIRE_WGPU=1 but no wgpu adapter{seen}");
                eprintln!("\n!!! SKIPPING the GPU forward tests: no wgpu adapter{seen}.\n");
                None
            }
            Err(other) => panic!("wgpu adapter present but unusable: {other}"),
        })
        .clone()
}

fn synthetic(weight_type: GgmlType) -> Arc<Model> {
    let cfg = support::small_llama(weight_type, false);
    let file = GgufFile::from_bytes(cfg.build()).expect("synthetic gguf parses");
    Arc::new(Model::from_gguf(Arc::new(file)).expect("synthetic model loads"))
}

fn pool(model: &Model) -> Arc<KvPool> {
    let layout = model.kv_layout(model.config.n_layers, 16);
    Arc::new(KvPool::new(KvPoolConfig::anonymous(layout, 64 * layout.n_layers)).expect("pool"))
}

fn prompt(len: usize, seed: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i * 37 + seed * 11 + 5) % 384)
        .collect()
}

/// Every position's logits on the CPU.
fn cpu_logits(model: &Model, tokens: &[u32]) -> Vec<f32> {
    let kv_pool = pool(model);
    let mut kv = SessionKv::new(kv_pool);
    let mut scratch = Scratch::default();
    let threads = ThreadPool::new(2);
    let mut seqs = [Sequence {
        kv: &mut kv,
        tokens,
        logits: LogitsWanted::All,
    }];
    model
        .forward(&mut seqs, &threads, &mut scratch)
        .expect("cpu forward");
    scratch.logits.clone()
}

struct Rig {
    kv_pool: Arc<KvPool>,
    forward: GpuForward,
}

impl Rig {
    fn new(device: &Arc<GpuDevice>, model: &Arc<Model>, capacity: StepCapacity) -> Self {
        let kv_pool = pool(model);
        let kv = DeviceKv::new(device, kv_pool.layout(), kv_pool.total_pages()).expect("device kv");
        Self::with_kv(device, model, capacity, kv_pool, &kv)
    }

    /// `n_pages` pages of KV over the device's KV buffers, `per_buffer`
    /// pages in each.
    fn spread(
        device: &Arc<GpuDevice>,
        model: &Arc<Model>,
        n_pages: usize,
        per_buffer: usize,
    ) -> Self {
        let layout = model.kv_layout(model.config.n_layers, 16);
        let kv_pool =
            Arc::new(KvPool::new(KvPoolConfig::anonymous(layout, n_pages)).expect("pool"));
        let kv = DeviceKv::with_buffer_pages(device, &layout, n_pages, per_buffer).expect("kv");
        assert!(
            kv.buffers.len() > 1 && n_pages > per_buffer,
            "the pages span several buffers"
        );
        Self::with_kv(device, model, StepCapacity::default(), kv_pool, &kv)
    }

    fn with_kv(
        device: &Arc<GpuDevice>,
        model: &Arc<Model>,
        capacity: StepCapacity,
        kv_pool: Arc<KvPool>,
        kv: &DeviceKv,
    ) -> Self {
        let gpu = GpuModel::new(Arc::clone(device), Arc::clone(model)).expect("upload");
        let forward = GpuForward::new(gpu, kv, capacity).expect("forward");
        Self { kv_pool, forward }
    }

    /// Feeds each sequence's tokens in the given chunk sizes, all sequences
    /// advancing together, and returns every position's logits as bits.
    fn run(&mut self, seqs: &[(&[u32], Vec<usize>)]) -> Vec<Vec<u32>> {
        let mut kvs: Vec<SessionKv> = seqs
            .iter()
            .map(|_| SessionKv::new(Arc::clone(&self.kv_pool)))
            .collect();
        let mut fed = vec![0usize; seqs.len()];
        let mut out = vec![Vec::new(); seqs.len()];
        let mut round = 0;
        let mut logits = Vec::new();
        loop {
            let mut feeds = Vec::new();
            let mut which = Vec::new();
            for (i, ((tokens, chunks), kv)) in seqs.iter().zip(kvs.iter_mut()).enumerate() {
                if let Some(&n) = chunks.get(round) {
                    let start = fed[i];
                    feeds.push(GpuFeed {
                        kv,
                        tokens: &tokens[start..start + n],
                        logits: LogitsWanted::All,
                        keep: None,
                    });
                    which.push(i);
                    fed[i] += n;
                }
            }
            if feeds.is_empty() {
                break;
            }
            let rows = self
                .forward
                .forward(&mut feeds, &mut logits)
                .expect("gpu forward");
            let vocab = logits.len() / rows.per_sequence.iter().map(|r| r.len()).sum::<usize>();
            for (&i, r) in which.iter().zip(&rows.per_sequence) {
                out[i].extend(
                    logits[r.start * vocab..r.end * vocab]
                        .iter()
                        .map(|v| v.to_bits()),
                );
            }
            round += 1;
        }
        out
    }
}

fn argmax(row: &[f32]) -> usize {
    let mut best = 0;
    for (i, v) in row.iter().enumerate() {
        if *v > row[best] {
            best = i;
        }
    }
    best
}

#[test]
fn logits_match_the_cpu_backend() {
    let Some(device) = device() else { return };
    for ty in [GgmlType::F32, GgmlType::Q8_0, GgmlType::Q4_1] {
        let model = synthetic(ty);
        let vocab = model.config.vocab;
        let tokens = prompt(40, 1);
        let want = cpu_logits(&model, &tokens);
        let mut rig = Rig::new(&device, &model, StepCapacity::default());
        let got: Vec<f32> = rig.run(&[(&tokens, vec![tokens.len()])])[0]
            .iter()
            .map(|b| f32::from_bits(*b))
            .collect();
        assert_eq!(got.len(), want.len());
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        let mut worst = 0f32;
        for (g, w) in got.iter().zip(&want) {
            worst = worst.max((g - w).abs());
        }
        eprintln!("{ty}: largest logit difference {worst} (logits up to {scale})");
        // The CPU quantizes activations to 8 bits before each product; the
        // GPU multiplies them as f32.
        let tolerance = if ty == GgmlType::F32 { 1e-3 } else { 0.05 } * scale;
        assert!(worst <= tolerance, "{ty}: {worst} > {tolerance}");
        let mut agree = 0;
        for (g, w) in got.chunks(vocab).zip(want.chunks(vocab)) {
            agree += usize::from(argmax(g) == argmax(w));
        }
        assert!(
            agree * 10 >= tokens.len() * 9,
            "{ty}: argmax agrees at {agree} of {}",
            tokens.len()
        );
    }
}

#[test]
fn logits_do_not_depend_on_how_the_history_was_fed() {
    let Some(device) = device() else { return };
    let model = synthetic(GgmlType::Q4_1);
    let a = prompt(37, 2);
    let b = prompt(29, 3);
    let mut rig = Rig::new(&device, &model, StepCapacity::default());
    let whole = rig.run(&[(&a, vec![a.len()])]).remove(0);
    let one_by_one = rig.run(&[(&a, vec![1; a.len()])]).remove(0);
    assert_eq!(whole, one_by_one, "token by token");
    let chunked = rig
        .run(&[(&a, vec![5, 16, 1, 15]), (&b, vec![29])])
        .remove(0);
    assert_eq!(whole, chunked, "in chunks beside another session");
    let second = rig
        .run(&[(&b, vec![3, 3, 3, 20]), (&a, vec![1, 36])])
        .remove(1);
    assert_eq!(whole, second, "second in its steps");
    // A step too small for the batch runs as several, to the same bits.
    let small = StepCapacity {
        tokens: 7,
        rows: 5,
        sequences: 2,
        scores: 4096,
        kept_rows: 1,
    };
    let mut tight = Rig::new(&device, &model, small);
    let split = tight.run(&[(&b, vec![29]), (&a, vec![37])]).remove(1);
    assert_eq!(whole, split, "split into small steps");
    // Pages over every KV buffer the kernels bind, the two sessions'
    // pages interleaved there.
    let per_buffer = 16usize.div_ceil(device.kv_bindings());
    let mut spread = Rig::spread(&device, &model, 16, per_buffer);
    let spread_out = spread
        .run(&[(&a, vec![5, 16, 1, 15]), (&b, vec![29])])
        .remove(0);
    assert_eq!(
        whole,
        spread_out,
        "pages spread over {} buffers",
        device.kv_bindings()
    );
}

/// A named real shape cut to two layers and a small vocabulary.
fn shaped(shape: &str, recipe: &str, sliding_window: Option<usize>) -> Arc<Model> {
    use inferd::gguf::synthetic::{SyntheticModel, TypeRecipe};
    let recipe = TypeRecipe::from_name(recipe).expect("recipe");
    let mut model = SyntheticModel::named(shape, recipe, 5).expect("named shape");
    model.shape = model.shape.with_layers(2).with_vocab(384);
    if sliding_window.is_some() {
        model.shape.sliding_window = sliding_window;
    }
    let file = GgufFile::from_bytes(model.try_build().expect("builds")).expect("parses");
    Arc::new(Model::from_gguf(Arc::new(file)).expect("loads"))
}

/// Every architecture's blocks on the device: llama (Llama 3 RoPE factors),
/// qwen2 (Q/K/V biases), qwen3 (Q/K norms), gemma3 (sliding windows shorter
/// than the prompt, post-norms, GeGLU, embedding scale, soft-capping), in
/// K-quant mixes: close to the CPU, and the same bits however fed.
#[test]
fn every_architecture_runs_on_the_device() {
    let Some(device) = device() else { return };
    for (shape, recipe, window) in [
        ("smollm2-135m", "q8_0", None),
        ("llama-3.2-1b", "q4_k_m", None),
        ("qwen2.5-0.5b", "q4_k_m", None),
        ("qwen3-0.6b", "q6_k", None),
        ("gemma-3-270m", "q8_0", Some(16)),
    ] {
        let model = shaped(shape, recipe, window);
        let vocab = model.config.vocab;
        let tokens = prompt(40, 4);
        let want = cpu_logits(&model, &tokens);
        let mut rig = Rig::new(&device, &model, StepCapacity::default());
        let whole = rig.run(&[(&tokens, vec![tokens.len()])]).remove(0);
        let got: Vec<f32> = whole.iter().map(|b| f32::from_bits(*b)).collect();
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        let worst = got
            .iter()
            .zip(&want)
            .fold(0f32, |m, (g, w)| m.max((g - w).abs()));
        eprintln!("{shape} {recipe}: largest logit difference {worst} (logits up to {scale})");
        assert!(
            worst <= 0.05 * scale,
            "{shape}: {worst} against logits up to {scale}"
        );
        let agree = got
            .chunks(vocab)
            .zip(want.chunks(vocab))
            .filter(|(g, w)| argmax(g) == argmax(w))
            .count();
        assert!(
            agree * 10 >= tokens.len() * 9,
            "{shape}: argmax agrees at {agree} of 40"
        );
        let pieces = rig.run(&[(&tokens, vec![7, 1, 20, 12])]).remove(0);
        assert_eq!(pieces, whole, "{shape}: fed in pieces");
    }
}

/// Hidden states after every layer of `model` for `tokens` fed in
/// `chunks`, computed by shards of `ranges` (on the device, or on the CPU
/// with `Model::forward_layers`), each with a KV of its own layers.
fn sharded(
    device: Option<&Arc<GpuDevice>>,
    model: &Arc<Model>,
    ranges: &[std::ops::Range<usize>],
    tokens: &[u32],
    chunks: &[usize],
) -> Vec<f32> {
    let hidden = model.config.hidden;
    let threads = ThreadPool::new(2);
    let mut scratch = Scratch::default();
    let mut stages: Vec<(Option<GpuForward>, SessionKv)> = ranges
        .iter()
        .map(|range| {
            let layout = model.kv_layout(range.len(), 16);
            let kv_pool = Arc::new(
                KvPool::new(KvPoolConfig::anonymous(layout, 64 * layout.n_layers)).expect("pool"),
            );
            let forward = device.map(|device| {
                let gpu =
                    GpuModel::new_part(Arc::clone(device), Arc::clone(model), range.clone(), false)
                        .expect("upload");
                let kv =
                    DeviceKv::new(device, kv_pool.layout(), kv_pool.total_pages()).expect("kv");
                GpuForward::new(gpu, &kv, StepCapacity::default()).expect("forward")
            });
            (forward, SessionKv::new(kv_pool))
        })
        .collect();
    let mut out = Vec::new();
    let mut fed = 0;
    for &n in chunks {
        let mut x = vec![0.0; n * hidden];
        model.embed(&tokens[fed..fed + n], &mut x).expect("embed");
        for ((forward, kv), range) in stages.iter_mut().zip(ranges) {
            kv.reserve(fed + n).expect("reserve");
            match forward {
                Some(forward) => forward
                    .forward_layers(&mut [GpuLayerFeed { kv, rows: n }], &mut x)
                    .expect("gpu layers"),
                None => model
                    .forward_layers(
                        range.clone(),
                        &mut [LayerFeed { kv, rows: n }],
                        &mut x,
                        &threads,
                        &mut scratch,
                    )
                    .expect("cpu layers"),
            }
            kv.commit(fed + n).expect("commit");
        }
        out.extend_from_slice(&x);
        fed += n;
    }
    out
}

#[test]
fn a_shards_layers_run_on_the_device() {
    let Some(device) = device() else {
        return;
    };
    let model = synthetic(GgmlType::Q8_0);
    let tokens = prompt(17, 3);
    let all = std::slice::from_ref(&(0..3));
    let whole = sharded(Some(&device), &model, all, &tokens, &[17]);
    let split = sharded(Some(&device), &model, &[0..1, 1..3], &tokens, &[7, 9, 1]);
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&whole), bits(&split), "split into shards and steps");
    let cpu = sharded(None, &model, all, &tokens, &[17]);
    let (mut err, mut norm) = (0.0f64, 0.0f64);
    for (g, c) in whole.iter().zip(&cpu) {
        err += f64::from(g - c).powi(2);
        norm += f64::from(*c).powi(2);
    }
    let relative = (err / norm).sqrt();
    eprintln!("a shard's hidden states, GPU against CPU: relative error {relative:.2e}");
    assert!(relative < 0.02, "relative error {relative}");
}
