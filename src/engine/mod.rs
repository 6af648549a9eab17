//! A single-process engine: one model, one compute pool, one KV page pool
//! and one sampler, serving sessions whose history is append-only.
//!
//! The CLI drives it directly (`inferd generate`, `chat`, `bench`); the
//! server does not use it: its runtime (`crate::runtime`) has its own
//! workers over the same model, KV pool and samplers. Every operation
//! validates its input and reserves the KV memory it needs before it
//! computes anything, so bad input or a full pool leaves the session
//! exactly as it was.

mod draft;
mod speculative;

use std::sync::Arc;
use std::time::{Duration, Instant};

use thiserror::Error;

use crate::kv::{KvBacking, KvError, KvPool, KvPoolConfig, SessionKv, DEFAULT_PAGE_POSITIONS};
use crate::model::{LogitsWanted, Model, ModelError, Scratch, Sequence};
use crate::sampler::{
    SampleRequest, SamplerBackend, SamplerError, SamplingParams, SelectedSampler,
};
use crate::threads::ThreadPool;

/// Why an engine operation failed. Nothing changed in the session.
#[derive(Debug, Error)]
pub enum EngineError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Kv(#[from] KvError),
    #[error(transparent)]
    Sampler(#[from] SamplerError),
    /// Generate needs at least one token of history to continue from.
    #[error("cannot generate from an empty history: append tokens first")]
    EmptyHistory,
    #[error(transparent)]
    Constraint(#[from] crate::constraint::ConstraintError),
    /// A draft model must speak the main model's vocabulary.
    #[error(
        "the draft model has {draft} tokens, the main model {main}: they must share one vocabulary"
    )]
    DraftVocabulary { draft: usize, main: usize },
    /// The GPU failed (at start, or during a step: the session is then lost).
    #[cfg(not(loom))]
    #[error(transparent)]
    Gpu(#[from] crate::gpu::GpuError),
}

#[cfg(not(loom))]
impl From<crate::gpu::ForwardError> for EngineError {
    fn from(e: crate::gpu::ForwardError) -> Self {
        match e {
            crate::gpu::ForwardError::Model(e) => Self::Model(e),
            crate::gpu::ForwardError::Gpu(e) => Self::Gpu(e),
        }
    }
}

/// How an engine is sized.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Compute threads for one forward pass (the caller included).
    pub threads: usize,
    /// KV memory budget in bytes (rounded down to whole pages).
    pub kv_bytes: u64,
    /// Positions per KV page.
    pub page_positions: usize,
    /// Longest run of tokens fed through one forward call during a prefill.
    pub prefill_chunk: usize,
    /// Where the KV pages live.
    pub kv_backing: KvBacking,
    /// The sampler, resolved once at start-up (the CPU by default).
    pub sampler: SelectedSampler,
    /// Run the model on this GPU instead of the CPU (`kv_backing` is then
    /// unused: the pages live on the device).
    #[cfg(not(loom))]
    pub gpu: Option<Arc<crate::gpu::GpuDevice>>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            kv_bytes: 256 << 20,
            page_positions: DEFAULT_PAGE_POSITIONS,
            prefill_chunk: 512,
            kv_backing: KvBacking::Anonymous,
            sampler: SelectedSampler::Cpu,
            #[cfg(not(loom))]
            gpu: None,
        }
    }
}

/// A conversation: its token history, the KV cache behind it, and the
/// logits that predict the next token.
pub struct Session {
    kv: SessionKv,
    history: Vec<u32>,
    /// Logits at the last history position (empty while history is empty).
    next_logits: Vec<f32>,
}

impl Session {
    /// Every token so far, prompt and generated alike.
    pub fn history(&self) -> &[u32] {
        &self.history
    }

    /// The logits that predict the token after the history.
    pub fn next_logits(&self) -> &[f32] {
        &self.next_logits
    }

    /// Bytes of KV data the history occupies.
    pub fn kv_live_bytes(&self) -> u64 {
        self.kv.live_bytes()
    }

    /// Positions cached in KV (equals the history length between calls).
    pub fn kv_len(&self) -> usize {
        self.kv.len()
    }
}

pub use crate::stop::StopReason;
pub use draft::Draft;
pub use speculative::{Proposer, Speculation};

/// What a generation produced.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Generation {
    pub tokens: Vec<u32>,
    pub stop: StopReason,
}

/// Timings of a benchmark run.
#[derive(Clone, Copy, Debug)]
pub struct BenchResult {
    pub prompt_tokens: usize,
    pub prefill: Duration,
    pub gen_tokens: usize,
    pub decode: Duration,
}

/// Model, compute threads, KV pool and sampler.
pub struct Engine {
    model: Arc<Model>,
    pool: ThreadPool,
    kv_pool: Arc<KvPool>,
    scratch: Scratch,
    sampler: SamplerBackend,
    prefill_chunk: usize,
    /// The forward pass on a GPU, when the engine runs there.
    #[cfg(not(loom))]
    gpu: Option<crate::gpu::GpuForward>,
    /// Whether the sampler is on that GPU and reads the logits a decode
    /// step keeps there (row 0 of the forward's kept logits), which then
    /// come back only once, at the end of a generation.
    #[cfg(not(loom))]
    samples_kept: bool,
    /// What its verification passes take, for sizing proposals
    /// (`speculative.rs`).
    pass_times: crate::speculate::PassTimes,
}

impl Engine {
    /// Builds an engine around a loaded model.
    pub fn new(model: Arc<Model>, cfg: &EngineConfig) -> Result<Self, EngineError> {
        let layout = model.kv_layout(model.config.n_layers, cfg.page_positions);
        let n_pages = KvPool::pages_for_bytes(&layout, cfg.kv_bytes).max(layout.n_layers);
        let host_pool = || {
            KvPool::new(KvPoolConfig {
                layout,
                n_pages,
                backing: cfg.kv_backing.clone(),
                prefault: false,
            })
        };
        #[cfg(not(loom))]
        let (pool, gpu) = match &cfg.gpu {
            Some(device) => {
                let (pool, kv) = crate::gpu::device_kv_pool(device, layout, n_pages)?;
                let gpu = crate::gpu::GpuModel::new(Arc::clone(device), Arc::clone(&model))?;
                let steps = crate::gpu::StepCapacity {
                    tokens: cfg.prefill_chunk.clamp(1, 512),
                    ..Default::default()
                };
                (pool, Some(crate::gpu::GpuForward::new(gpu, &kv, steps)?))
            }
            None => (host_pool()?, None),
        };
        #[cfg(loom)]
        let pool = host_pool()?;
        let kv_pool =
            Arc::new(pool.with_layer_windows(model.kv_layer_windows(0..model.config.n_layers))?);
        #[allow(unused_mut)]
        let mut sampler = cfg
            .sampler
            .backend(model.config.vocab, model.config.context)?;
        // A sampler on the model's own device reads its kept logits.
        #[cfg(not(loom))]
        let samples_kept = match (&gpu, sampler.gpu_mut()) {
            (Some(forward), Some(gpu_sampler))
                if gpu_sampler.context().shares_device(forward.device()) =>
            {
                let (buffer, rows) = forward.kept();
                gpu_sampler.read_kept_from(forward.device(), buffer, rows as u32);
                true
            }
            _ => false,
        };
        Ok(Self {
            model,
            pool: ThreadPool::new(cfg.threads),
            kv_pool,
            scratch: Scratch::default(),
            sampler,
            prefill_chunk: cfg.prefill_chunk.max(1),
            #[cfg(not(loom))]
            gpu,
            #[cfg(not(loom))]
            samples_kept,
            pass_times: Default::default(),
        })
    }

    /// The GPU the model runs on, if not the CPU.
    #[cfg(not(loom))]
    pub fn gpu_adapter(&self) -> Option<String> {
        self.gpu.as_ref().map(|g| g.device().describe())
    }

    /// Rows of logits read back from the GPU so far (`None` on the CPU).
    #[cfg(not(loom))]
    pub fn logit_rows_read(&self) -> Option<u64> {
        self.gpu.as_ref().map(|g| g.logit_rows_read())
    }

    /// Submissions made on the GPU so far (`None` on the CPU).
    #[cfg(not(loom))]
    pub fn gpu_submissions(&self) -> Option<u64> {
        self.gpu.as_ref().map(|g| g.device().submissions())
    }

    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    pub fn kv_pool(&self) -> &Arc<KvPool> {
        &self.kv_pool
    }

    pub fn threads(&self) -> usize {
        self.pool.threads()
    }

    /// A new, empty session.
    pub fn new_session(&self) -> Session {
        Session {
            kv: SessionKv::new(Arc::clone(&self.kv_pool)),
            history: Vec::new(),
            next_logits: Vec::new(),
        }
    }

    /// Appends `tokens` to the history, computing KV for the new positions
    /// only. All-or-nothing: ids are checked and KV for the whole append is
    /// reserved before anything is computed.
    pub fn append(&mut self, session: &mut Session, tokens: &[u32]) -> Result<(), EngineError> {
        if tokens.is_empty() {
            return Ok(());
        }
        self.model.check_append(session.kv.len(), tokens)?;
        session.kv.reserve(session.kv.len() + tokens.len())?;
        let chunks: Vec<&[u32]> = tokens.chunks(self.prefill_chunk).collect();
        for (i, chunk) in chunks.iter().enumerate() {
            let want = if i + 1 == chunks.len() {
                LogitsWanted::Last
            } else {
                LogitsWanted::None
            };
            self.forward_one(session, chunk, want)?;
        }
        Ok(())
    }

    fn forward_one(
        &mut self,
        session: &mut Session,
        tokens: &[u32],
        want: LogitsWanted,
    ) -> Result<(), EngineError> {
        let rows = self.forward_unsettled(session, tokens, want)?;
        // Nothing will roll these positions back, so window pages can go now.
        session.kv.settle()?;
        if want != LogitsWanted::None {
            self.keep_logits(session, rows.end - 1);
        }
        Ok(())
    }

    /// Feeds `tokens` (KV reserved) through one forward call and commits
    /// them to the history; the rows of the scratch logits they got. Window
    /// pages are not settled: the caller may still roll positions back.
    fn forward_unsettled(
        &mut self,
        session: &mut Session,
        tokens: &[u32],
        want: LogitsWanted,
    ) -> Result<std::ops::Range<usize>, EngineError> {
        let mut seqs = [Sequence {
            kv: &mut session.kv,
            tokens,
            logits: want,
        }];
        let rows = self.forward_seqs(&mut seqs)?;
        session.history.extend_from_slice(tokens);
        Ok(rows.per_sequence[0].clone())
    }

    /// Row `row` of the scratch logits becomes the session's next logits.
    fn keep_logits(&self, session: &mut Session, row: usize) {
        let vocab = self.model.config.vocab;
        session.next_logits.clear();
        session
            .next_logits
            .extend_from_slice(&self.scratch.logits[row * vocab..][..vocab]);
    }

    /// One forward call on the CPU or the GPU.
    fn forward_seqs(
        &mut self,
        seqs: &mut [Sequence<'_>],
    ) -> Result<crate::model::LogitRows, EngineError> {
        #[cfg(not(loom))]
        if let Some(gpu) = &mut self.gpu {
            let mut feeds: Vec<crate::gpu::GpuFeed<'_>> = seqs
                .iter_mut()
                .map(|s| crate::gpu::GpuFeed {
                    kv: &mut *s.kv,
                    tokens: s.tokens,
                    logits: s.logits,
                    keep: None,
                })
                .collect();
            return Ok(gpu.forward(&mut feeds, &mut self.scratch.logits)?);
        }
        Ok(self.model.forward(seqs, &self.pool, &mut self.scratch)?)
    }

    /// Generates up to `max_tokens` tokens. Each token is sampled from the
    /// logits at the end of the history, committed to the history (its KV
    /// computed), then passed to `on_token`; returning `false` from it stops
    /// the generation with the tokens so far committed. A token in
    /// `stop_tokens` is emitted and committed, then ends the generation.
    pub fn generate(
        &mut self,
        session: &mut Session,
        params: &SamplingParams,
        max_tokens: usize,
        stop_tokens: &[u32],
        on_token: impl FnMut(u32) -> bool,
    ) -> Result<Generation, EngineError> {
        self.generate_constrained(session, params, max_tokens, stop_tokens, None, on_token)
    }

    /// [`Engine::generate`] with the output held to `constraint` (see
    /// `crate::constraint`): a complete match ends it with
    /// [`StopReason::ConstraintDone`], `max_tokens` before the text can end
    /// with [`StopReason::ConstraintUnfinished`].
    pub fn generate_constrained(
        &mut self,
        session: &mut Session,
        params: &SamplingParams,
        max_tokens: usize,
        stop_tokens: &[u32],
        mut constraint: Option<&mut crate::constraint::Constraint>,
        mut on_token: impl FnMut(u32) -> bool,
    ) -> Result<Generation, EngineError> {
        let params = params.clone().checked(self.model.config.vocab)?;
        if session.history.is_empty() || session.next_logits.is_empty() {
            return Err(EngineError::EmptyHistory);
        }
        let mut tokens = Vec::new();
        let mut mask = Vec::new();
        // Whether the next logits are the ones a step kept on the GPU.
        let mut on_device = false;
        let stop = loop {
            if let Some(end) = end_before_sampling(
                constraint.as_deref_mut(),
                &tokens,
                max_tokens,
                stop_tokens,
                &mut mask,
            )? {
                break end;
            }
            let request = SampleRequest {
                logits: &session.next_logits,
                params: &params,
                history: &session.history,
                position: session.history.len() as u64,
                top_logprobs: 0,
                mask: constraint.is_some().then_some(&mask[..]),
            };
            let token = if on_device {
                self.sample_kept(&request)?
            } else {
                self.sampler.sample(request)?.token
            };
            if let Some(c) = constraint.as_mut() {
                c.accept(token, stop_tokens)?;
            }
            on_device = self.decode(session, token)?;
            tokens.push(token);
            let go_on = on_token(token);
            let is_stop = stop_tokens.contains(&token);
            if let Some(end) = constraint.as_ref().and_then(|c| c.end_after(is_stop)) {
                break end;
            }
            if is_stop {
                break StopReason::Eos;
            }
            if !go_on {
                break StopReason::Cancelled;
            }
        };
        if on_device {
            self.bring_logits_home(session)?;
        }
        Ok(Generation { tokens, stop })
    }

    /// Feeds one generated token. With a sampler on the GPU its logits
    /// stay there (returns `true`; the session's host copy is then empty
    /// until [`Engine::bring_logits_home`]).
    fn decode(&mut self, session: &mut Session, token: u32) -> Result<bool, EngineError> {
        #[cfg(not(loom))]
        if let (Some(gpu), true) = (&mut self.gpu, self.samples_kept) {
            self.model.check_append(session.kv.len(), &[token])?;
            session.kv.reserve(session.kv.len() + 1)?;
            let mut feeds = [crate::gpu::GpuFeed {
                kv: &mut session.kv,
                tokens: &[token],
                logits: LogitsWanted::Last,
                keep: Some(0),
            }];
            gpu.forward(&mut feeds, &mut self.scratch.logits)?;
            session.kv.settle()?;
            session.history.push(token);
            session.next_logits.clear();
            return Ok(true);
        }
        self.append(session, &[token])?;
        Ok(false)
    }

    /// Samples the logits the last decode step kept on the GPU.
    fn sample_kept(&mut self, request: &SampleRequest<'_>) -> Result<u32, EngineError> {
        #[cfg(not(loom))]
        if let Some(gpu_sampler) = self.sampler.gpu_mut().filter(|_| self.samples_kept) {
            let mut out = Vec::with_capacity(1);
            gpu_sampler.sample_kept(
                &[crate::sampler::gpu::KeptRow {
                    row: 0,
                    request: request.row(),
                }],
                &mut out,
            );
            return Ok(out.pop().unwrap_or(Err(SamplerError::EmptyLogits))?.token);
        }
        Ok(self.sampler.sample(*request)?.token)
    }

    /// Copies the logits the last decode step kept on the GPU to the
    /// session (once per generation).
    fn bring_logits_home(&mut self, session: &mut Session) -> Result<(), EngineError> {
        #[cfg(loom)]
        let _ = session;
        #[cfg(not(loom))]
        if let Some(gpu) = &self.gpu {
            session.next_logits = gpu.read_kept(0)?;
        }
        Ok(())
    }

    /// The llama-bench equivalent: prefill `prompt_tokens` tokens in one
    /// batch into a session holding `depth` tokens, then, in another session
    /// holding `depth` tokens, decode `gen_tokens` tokens one at a time.
    pub fn bench(
        &mut self,
        depth: usize,
        prompt_tokens: usize,
        gen_tokens: usize,
    ) -> Result<BenchResult, EngineError> {
        let vocab = self.model.config.vocab as u32;
        let filler = |n: usize, salt: u32| -> Vec<u32> {
            (0..n as u32).map(|i| (i * 7919 + salt) % vocab).collect()
        };
        let prompt = filler(prompt_tokens, 13);
        let context = filler(depth, 101);
        let mut s = self.new_session();
        self.append(&mut s, &context)?;
        let t0 = Instant::now();
        if !prompt.is_empty() {
            s.kv.reserve(prompt.len())?;
            self.forward_one(&mut s, &prompt, LogitsWanted::Last)?;
        }
        let prefill = t0.elapsed();
        drop(s);
        let mut s = self.new_session();
        self.append(&mut s, &context)?;
        let t0 = Instant::now();
        let mut token = 1 % vocab;
        let greedy = crate::sampler::SamplingParams::greedy().checked(vocab as usize)?;
        for _ in 0..gen_tokens {
            // Greedy on the GPU's sampler where the logits stay there.
            token = if self.decode(&mut s, token)? {
                self.sample_kept(&SampleRequest {
                    logits: &[],
                    params: &greedy,
                    history: &s.history,
                    position: s.history.len() as u64,
                    top_logprobs: 0,
                    mask: None,
                })?
            } else {
                crate::sampler::argmax(&s.next_logits).unwrap_or(0)
            };
        }
        let decode = t0.elapsed();
        Ok(BenchResult {
            prompt_tokens,
            prefill,
            gen_tokens,
            decode,
        })
    }
}

/// How a generation ends before sampling its next token, if it does:
/// `max_tokens` reached (cut mid-match for a constraint), or a constraint
/// whose text is complete or stuck. Otherwise `mask` holds the
/// constraint's mask for the next token.
pub(crate) fn end_before_sampling(
    constraint: Option<&mut crate::constraint::Constraint>,
    tokens: &[u32],
    max_tokens: usize,
    stop_tokens: &[u32],
    mask: &mut Vec<u32>,
) -> Result<Option<StopReason>, EngineError> {
    match constraint {
        _ if tokens.len() < max_tokens => {}
        Some(c) => return Ok(Some(c.end_at_limit())),
        None => return Ok(Some(StopReason::MaxTokens)),
    }
    Ok(match constraint {
        Some(c) => c.allowed(stop_tokens, mask)?.end(),
        None => None,
    })
}
