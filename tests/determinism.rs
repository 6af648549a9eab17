//! Byte-exact incremental prefill (CONTRACT §2.2): the logits at every
//! position are bit-identical however the history was fed — one chunk, one
//! token at a time, random chunk sizes, 1 or 2 threads, or batched with
//! other sequences — on a synthetic model (every weight format) and on the
//! reference model.

mod support;

use std::path::Path;
use std::sync::Arc;

use inferd::gguf::GgufFile;
use inferd::kv::{KvPool, KvPoolConfig, SessionKv};
use inferd::model::{LayerFeed, LogitsWanted, Model, Scratch, Sequence};
use inferd::quant::GgmlType;
use inferd::threads::ThreadPool;
use rand::{Rng, SeedableRng};

const REFERENCE: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";

struct Rig {
    model: Model,
    kv: Arc<KvPool>,
}

impl Rig {
    fn new(model: Model) -> Self {
        let layout = model.kv_layout(model.config.n_layers, 16);
        let pages = 256 * layout.n_layers;
        let kv = Arc::new(KvPool::new(KvPoolConfig::anonymous(layout, pages)).expect("kv pool"));
        Self { model, kv }
    }

    fn synthetic(weight_type: GgmlType, tied: bool) -> Self {
        let cfg = support::small_llama(weight_type, tied);
        let file = GgufFile::from_bytes(cfg.build()).expect("synthetic gguf parses");
        Self::new(Model::from_gguf(Arc::new(file)).expect("synthetic model loads"))
    }

    /// Feeds each sequence's tokens in the given chunk sizes, all sequences
    /// advancing together in the same forward calls, and returns every
    /// position's logits as bits, per sequence.
    fn run(&self, seqs: &[(&[u32], Vec<usize>)], threads: usize) -> Vec<Vec<u32>> {
        let pool = ThreadPool::new(threads);
        let mut scratch = Scratch::default();
        let vocab = self.model.config.vocab;
        let mut kvs: Vec<SessionKv> = seqs
            .iter()
            .map(|_| SessionKv::new(Arc::clone(&self.kv)))
            .collect();
        let mut out: Vec<Vec<u32>> = vec![Vec::new(); seqs.len()];
        let mut fed = vec![0usize; seqs.len()];
        let mut step = 0;
        loop {
            let mut batch = Vec::new();
            let mut who = Vec::new();
            for (i, ((tokens, chunks), kv)) in seqs.iter().zip(kvs.iter_mut()).enumerate() {
                if let Some(&n) = chunks.get(step) {
                    batch.push(Sequence {
                        kv,
                        tokens: &tokens[fed[i]..fed[i] + n],
                        logits: LogitsWanted::All,
                    });
                    who.push(i);
                    fed[i] += n;
                }
            }
            if batch.is_empty() {
                break;
            }
            let rows = self
                .model
                .forward(&mut batch, &pool, &mut scratch)
                .expect("forward");
            for (b, &i) in who.iter().enumerate() {
                let r = rows.per_sequence[b].clone();
                out[i].extend(
                    scratch.logits[r.start * vocab..r.end * vocab]
                        .iter()
                        .map(|x| x.to_bits()),
                );
            }
            step += 1;
        }
        for (i, (tokens, _)) in seqs.iter().enumerate() {
            assert_eq!(fed[i], tokens.len());
            assert_eq!(kvs[i].len(), tokens.len());
        }
        out
    }
}

fn random_chunks(len: usize, max: usize, seed: u64) -> Vec<usize> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut chunks = Vec::new();
    let mut left = len;
    while left > 0 {
        let n = rng.gen_range(1..=max.min(left));
        chunks.push(n);
        left -= n;
    }
    chunks
}

fn tokens(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..n).map(|_| rng.gen_range(0..vocab as u32)).collect()
}

/// Checks every way of feeding `history` against feeding it in one chunk.
fn assert_chunking_invariant(rig: &Rig, history: &[u32]) {
    let n = history.len();
    let vocab = rig.model.config.vocab;
    let reference = rig.run(&[(history, vec![n])], 2).remove(0);
    assert_eq!(reference.len(), n * vocab);
    assert!(
        reference.iter().all(|b| f32::from_bits(*b).is_finite()),
        "logits must be finite"
    );

    let one_by_one = rig.run(&[(history, vec![1; n])], 2).remove(0);
    assert!(
        one_by_one == reference,
        "one token at a time differs from one chunk"
    );

    for seed in [1, 2, 3] {
        let chunks = random_chunks(n, 40, seed);
        let got = rig.run(&[(history, chunks.clone())], 2).remove(0);
        assert!(got == reference, "random chunking {chunks:?} differs");
    }

    let single_thread = rig.run(&[(history, random_chunks(n, 64, 9))], 1).remove(0);
    assert!(single_thread == reference, "1 thread differs from 2");

    // Batched alongside two other sequences with their own chunkings.
    let other_a = tokens(n / 2 + 17, vocab, 11);
    let other_b = tokens(n / 3 + 5, vocab, 12);
    let batched = rig.run(
        &[
            (&other_a, random_chunks(other_a.len(), 33, 4)),
            (history, random_chunks(n, 25, 5)),
            (&other_b, random_chunks(other_b.len(), 7, 6)),
        ],
        2,
    );
    assert!(
        batched[1] == reference,
        "batched with other sequences differs"
    );
    let alone_a = rig.run(&[(&other_a, vec![other_a.len()])], 2).remove(0);
    assert!(
        batched[0] == alone_a,
        "the neighbour sequence itself changed when batched"
    );
}

#[test]
fn synthetic_model_is_chunking_invariant_in_every_weight_format() {
    for (ty, tied) in [
        (GgmlType::Q4_1, true),
        (GgmlType::Q8_0, false),
        (GgmlType::F16, true),
        (GgmlType::F32, false),
    ] {
        let rig = Rig::synthetic(ty, tied);
        let history = tokens(230, rig.model.config.vocab, ty.id() as u64);
        assert_chunking_invariant(&rig, &history);
    }
}

#[test]
fn reference_model_is_chunking_invariant() {
    if !Path::new(REFERENCE).exists() {
        eprintln!("SKIPPED: {REFERENCE} is absent; run scripts/fetch-model");
        return;
    }
    let rig = Rig::new(Model::load(REFERENCE).expect("reference model loads"));
    let history = tokens(210, rig.model.config.vocab, 42);
    assert_chunking_invariant(&rig, &history);
}

#[test]
fn a_failed_append_changes_nothing() {
    let rig = Rig::synthetic(GgmlType::Q8_0, true);
    let pool = ThreadPool::new(2);
    let mut scratch = Scratch::default();
    let mut kv = SessionKv::new(Arc::clone(&rig.kv));
    let good = tokens(20, rig.model.config.vocab, 1);
    rig.model
        .forward(
            &mut [Sequence {
                kv: &mut kv,
                tokens: &good,
                logits: LogitsWanted::Last,
            }],
            &pool,
            &mut scratch,
        )
        .expect("good append");
    let bad = [1, 2, rig.model.config.vocab as u32];
    let err = rig
        .model
        .forward(
            &mut [Sequence {
                kv: &mut kv,
                tokens: &bad,
                logits: LogitsWanted::Last,
            }],
            &pool,
            &mut scratch,
        )
        .expect_err("out-of-vocabulary id must fail");
    assert!(err.to_string().contains("outside the vocabulary"), "{err}");
    assert_eq!(kv.len(), 20);
}

/// A model split by layer ranges, each range with its own KV pool (as
/// shards will hold), gives the same logits bits as the whole model.
#[test]
fn layer_ranges_computed_separately_give_the_same_logits() {
    let rig = Rig::synthetic(GgmlType::Q4_1, true);
    let model = &rig.model;
    let (n_layers, hidden, vocab) = (
        model.config.n_layers,
        model.config.hidden,
        model.config.vocab,
    );
    let history = tokens(90, vocab, 21);
    let reference = rig
        .run(&[(&history, random_chunks(history.len(), 30, 2))], 2)
        .remove(0);

    let pool = ThreadPool::new(2);
    let mut scratch = Scratch::default();
    let ranges = [0..1, 1..n_layers];
    let mut kvs: Vec<SessionKv> = ranges
        .iter()
        .map(|r| {
            let layout = model.kv_layout(r.len(), 16);
            let pages = 16 * layout.n_layers;
            let pool =
                Arc::new(KvPool::new(KvPoolConfig::anonymous(layout, pages)).expect("kv pool"));
            SessionKv::new(pool)
        })
        .collect();
    let mut got = Vec::new();
    let mut logits = Vec::new();
    for chunk in history.chunks(25) {
        let mut x = vec![0f32; chunk.len() * hidden];
        model.embed(chunk, &mut x).expect("embed");
        for (range, kv) in ranges.iter().zip(kvs.iter_mut()) {
            kv.reserve(kv.len() + chunk.len()).expect("reserve");
            let mut feed = [LayerFeed {
                kv,
                rows: chunk.len(),
            }];
            model
                .forward_layers(range.clone(), &mut feed, &mut x, &pool, &mut scratch)
                .expect("layer range");
            let new_len = feed[0].kv.len() + chunk.len();
            feed[0].kv.commit(new_len).expect("commit");
        }
        model.logits_from_hidden(&pool, &x, &mut logits, &mut scratch);
        got.extend(logits.iter().map(|v| v.to_bits()));
    }
    assert!(
        got == reference,
        "split layer ranges differ from the whole model"
    );
}
