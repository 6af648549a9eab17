//! The sampler as WGSL compute through wgpu: the host side of
//! `shaders/sampler.wgsl`.
//!
//! A [`GpuSampler`] belongs to one worker and owns every buffer its steps
//! use, created once: an upload buffer the host writes through a mapping
//! (logits rows, then the rows' request words), device-side copies of
//! both, the shader's scratch, and a readback buffer for the results. One
//! step maps nothing new and creates nothing: it writes the mapped upload
//! buffer, unmaps it, records two copies, one dispatch (a workgroup per
//! row) and one copy back, submits once, then maps the readback and the
//! upload buffer again for the next step. (`Queue::write_buffer` is not
//! used because wgpu creates a staging buffer for every call.)
//!
//! Logits the layers keep on the same device ([`KeptRow`]) are read where
//! they are: nothing but the rows' requests goes up, and only token ids
//! and log-probabilities come back.
//!
//! Rows that fail the shared input checks never reach the GPU; they get the
//! same typed error the CPU sampler gives.

mod context;
mod layout;

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_executor::block_on;

pub use context::{AdapterKind, GpuContext, GpuError, ResourceCounts};
pub use layout::{MAX_VOCAB, WORKGROUP_SIZE};

use super::{check_row, RowRequest, SampleRequest, Sampled, SamplerError, TokenLogprobs};
use layout::{
    pack_row, request_words, PARAM_WORDS, RESULT_WORDS, R_CHOSEN, R_INFINITIES, R_NORMALISER,
    R_STATUS, R_TOKEN, R_TOP, R_TOP_COUNT, STATUS_NO_CANDIDATE, STATUS_OK,
};

/// Rows one dispatch samples unless the device's limits ask for fewer.
pub const DEFAULT_MAX_ROWS: usize = 32;
/// How long a step may take on the device before it counts as lost.
const STEP_TIMEOUT: Duration = Duration::from_secs(30);

/// Map-callback outcome slots: pending, done, failed.
const MAP_PENDING: u8 = 0;
const MAP_DONE: u8 = 1;
const MAP_FAILED: u8 = 2;

/// One worker's GPU sampler; see the module docs.
pub struct GpuSampler {
    context: Arc<GpuContext>,
    vocab_size: usize,
    max_rows: usize,
    /// Words the request buffers hold.
    request_capacity: usize,
    upload: wgpu::Buffer,
    logits: wgpu::Buffer,
    requests: wgpu::Buffer,
    results: wgpu::Buffer,
    readback: wgpu::Buffer,
    /// Kept alive beside the bind group that names them.
    fixed: FixedBuffers,
    bind_group: wgpu::BindGroup,
    /// Logits kept on the device by the layers, when they share it.
    kept: Option<KeptLogits>,
    upload_mapped: bool,
    /// A failed step leaves the mapping state unknown: refuse from then on.
    broken: Option<StepError>,
    /// Host-side request words, reused across steps.
    words: Vec<u32>,
    /// Indices of the rows in the current dispatch, reused across steps.
    chunk: Vec<usize>,
    upload_state: Arc<AtomicU8>,
    readback_state: Arc<AtomicU8>,
}

/// A row whose logits the layers keep on this sampler's device: row `row`
/// of the buffer given to [`GpuSampler::read_kept_from`].
#[derive(Clone, Copy, Debug)]
pub struct KeptRow<'a> {
    pub row: u32,
    pub request: RowRequest<'a>,
}

/// The layers' buffer of kept logit rows, and the bind group reading it.
struct KeptLogits {
    /// The model's device: its deferred layers go out with each dispatch.
    device: Arc<crate::gpu::GpuDevice>,
    buffer: wgpu::Buffer,
    rows: u32,
    bind_group: wgpu::BindGroup,
}

/// Where a batch's logits are.
#[derive(Clone, Copy)]
enum Rows<'r, 'a> {
    /// Uploaded with the requests, row by row.
    Host(&'r [SampleRequest<'a>]),
    /// Already on the device.
    Kept(&'r [KeptRow<'a>]),
}

impl<'a> Rows<'_, 'a> {
    fn len(&self) -> usize {
        match self {
            Rows::Host(rows) => rows.len(),
            Rows::Kept(rows) => rows.len(),
        }
    }

    fn request(&self, i: usize) -> RowRequest<'a> {
        match self {
            Rows::Host(rows) => rows[i].row(),
            Rows::Kept(rows) => rows[i].request,
        }
    }

    /// The row of the bound logits that dispatch slot `slot` samples.
    fn logits_row(&self, i: usize, slot: usize) -> u32 {
        match self {
            Rows::Host(_) => slot as u32,
            Rows::Kept(rows) => rows[i].row,
        }
    }
}

/// Buffers whose size never changes: uniforms and shader scratch.
struct FixedBuffers {
    globals: wgpu::Buffer,
    work: wgpu::Buffer,
    counts: wgpu::Buffer,
    scratch: wgpu::Buffer,
}

impl std::fmt::Debug for GpuSampler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuSampler")
            .field("adapter", &self.context.describe())
            .field("vocab_size", &self.vocab_size)
            .field("max_rows", &self.max_rows)
            .finish()
    }
}

fn bytes(words: usize) -> u64 {
    (words * 4) as u64
}

impl Drop for GpuSampler {
    fn drop(&mut self) {
        self.context.samplers.fetch_sub(1, Ordering::Relaxed);
    }
}

impl GpuSampler {
    /// Buffers for up to `max_rows` rows of `vocab_size` logits per
    /// dispatch, with room for `history_hint` penalty-window tokens per row
    /// (more is handled by growing the request buffers once).
    pub fn new(
        context: Arc<GpuContext>,
        vocab_size: usize,
        max_rows: usize,
        history_hint: usize,
    ) -> Result<GpuSampler, GpuError> {
        let pipeline_error = |message: String| GpuError::Pipeline {
            adapter: context.describe(),
            message,
        };
        if vocab_size == 0 || vocab_size > MAX_VOCAB as usize {
            return Err(pipeline_error(format!(
                "a vocabulary of {vocab_size} tokens is outside the shader's 1..={MAX_VOCAB}"
            )));
        }
        let scratch_stride = vocab_size.next_power_of_two();
        let limits = &context.limits;
        let biggest_per_row = (2 * vocab_size * 4).max(scratch_stride * 8) as u64;
        let limit = limits
            .max_storage_buffer_binding_size
            .min(limits.max_buffer_size);
        let max_rows = max_rows.max(1).min((limit / biggest_per_row) as usize);
        if max_rows == 0 {
            return Err(pipeline_error(format!(
                "one row needs {biggest_per_row} bytes of storage; the device allows {limit}"
            )));
        }
        let request_capacity = max_rows * (PARAM_WORDS + history_hint + 256);
        let device = &context.device;
        let storage = |label: &str, size: u64, extra: wgpu::BufferUsages| {
            device.create_buffer(&wgpu::BufferDescriptor {
                label: Some(label),
                size,
                usage: wgpu::BufferUsages::STORAGE | extra,
                mapped_at_creation: false,
            })
        };
        let scope = device.push_error_scope(wgpu::ErrorFilter::Validation);
        let globals = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("sampler globals"),
            size: 16,
            usage: wgpu::BufferUsages::UNIFORM,
            mapped_at_creation: true,
        });
        {
            let values: [u32; 4] = [
                vocab_size as u32,
                0, // opaque_zero
                (max_rows * vocab_size) as u32,
                scratch_stride as u32,
            ];
            let mut view = globals
                .get_mapped_range_mut(..)
                .map_err(|e| pipeline_error(e.to_string()))?;
            view.copy_from_slice(bytemuck::cast_slice(&values));
        }
        globals.unmap();
        let fixed = FixedBuffers {
            globals,
            work: storage(
                "sampler work",
                bytes(2 * max_rows * vocab_size),
                wgpu::BufferUsages::empty(),
            ),
            counts: storage(
                "sampler counts",
                bytes(max_rows * vocab_size),
                wgpu::BufferUsages::empty(),
            ),
            scratch: storage(
                "sampler scratch",
                bytes(2 * max_rows * scratch_stride),
                wgpu::BufferUsages::empty(),
            ),
        };
        let logits = storage(
            "sampler logits",
            bytes(max_rows * vocab_size),
            wgpu::BufferUsages::COPY_DST,
        );
        let results = storage(
            "sampler results",
            bytes(max_rows * RESULT_WORDS),
            wgpu::BufferUsages::COPY_SRC,
        );
        let readback = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("sampler readback"),
            size: bytes(max_rows * RESULT_WORDS),
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let (upload, requests) =
            Self::request_buffers(device, max_rows * vocab_size, request_capacity);
        let bind_group = Self::bind_group(&context, &fixed, &logits, &requests, &results);
        if let Some(error) = block_on(scope.pop()) {
            return Err(pipeline_error(error.to_string()));
        }
        context.samplers.fetch_add(1, Ordering::Relaxed);
        Ok(GpuSampler {
            context,
            vocab_size,
            max_rows,
            request_capacity,
            upload,
            logits,
            requests,
            results,
            readback,
            fixed,
            bind_group,
            kept: None,
            upload_mapped: true,
            broken: None,
            words: Vec::with_capacity(request_capacity),
            chunk: Vec::with_capacity(max_rows),
            upload_state: Arc::new(AtomicU8::new(MAP_PENDING)),
            readback_state: Arc::new(AtomicU8::new(MAP_PENDING)),
        })
    }

    /// The upload buffer (mapped, logits then request words) and the
    /// device-side request buffer.
    fn request_buffers(
        device: &wgpu::Device,
        logits_words: usize,
        request_words: usize,
    ) -> (wgpu::Buffer, wgpu::Buffer) {
        let upload = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("sampler upload"),
            size: bytes(logits_words + request_words),
            usage: wgpu::BufferUsages::MAP_WRITE | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: true,
        });
        let requests = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("sampler requests"),
            size: bytes(request_words),
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        (upload, requests)
    }

    fn bind_group(
        context: &GpuContext,
        fixed: &FixedBuffers,
        logits: &wgpu::Buffer,
        requests: &wgpu::Buffer,
        results: &wgpu::Buffer,
    ) -> wgpu::BindGroup {
        let entries = [
            &fixed.globals,
            logits,
            requests,
            &fixed.work,
            &fixed.counts,
            &fixed.scratch,
            results,
        ];
        let entries: Vec<wgpu::BindGroupEntry<'_>> = entries
            .iter()
            .enumerate()
            .map(|(binding, buffer)| wgpu::BindGroupEntry {
                binding: binding as u32,
                resource: buffer.as_entire_binding(),
            })
            .collect();
        context
            .device
            .create_bind_group(&wgpu::BindGroupDescriptor {
                label: Some("sampler bind group"),
                layout: &context.layout,
                entries: &entries,
            })
    }

    /// The context this sampler runs on.
    pub fn context(&self) -> &Arc<GpuContext> {
        &self.context
    }

    /// Reads [`KeptRow`]s from `buffer` (`rows` rows of the vocabulary's
    /// logits, on this sampler's device) from now on.
    pub fn read_kept_from(
        &mut self,
        device: &Arc<crate::gpu::GpuDevice>,
        buffer: &wgpu::Buffer,
        rows: u32,
    ) {
        let bind_group = Self::bind_group(
            &self.context,
            &self.fixed,
            buffer,
            &self.requests,
            &self.results,
        );
        self.kept = Some(KeptLogits {
            device: Arc::clone(device),
            buffer: buffer.clone(),
            rows,
            bind_group,
        });
    }

    /// Rows one dispatch takes.
    pub fn max_rows(&self) -> usize {
        self.max_rows
    }

    /// Samples every row; `out[i]` answers `rows[i]`. Valid rows go to the
    /// GPU, `max_rows` per dispatch (so a batch within that is one dispatch
    /// and one submission).
    pub fn sample_batch(
        &mut self,
        rows: &[SampleRequest<'_>],
        out: &mut Vec<Result<Sampled, SamplerError>>,
    ) {
        self.sample(Rows::Host(rows), out);
    }

    /// Samples rows whose logits are kept on the device, as
    /// [`GpuSampler::sample_batch`] does the host's.
    pub fn sample_kept(
        &mut self,
        rows: &[KeptRow<'_>],
        out: &mut Vec<Result<Sampled, SamplerError>>,
    ) {
        self.sample(Rows::Kept(rows), out);
    }

    fn sample(&mut self, rows: Rows<'_, '_>, out: &mut Vec<Result<Sampled, SamplerError>>) {
        out.clear();
        for i in 0..rows.len() {
            out.push(self.check(rows, i).map(|()| Sampled::token(0)));
        }
        let mut next = 0;
        while next < rows.len() {
            self.chunk.clear();
            let mut words = self.max_rows * PARAM_WORDS;
            while next < rows.len() && self.chunk.len() < self.max_rows {
                if out[next].is_err() {
                    next += 1;
                    continue;
                }
                let row = rows.request(next);
                let wanted = request_words(row.params, row.history, row.mask) - PARAM_WORDS;
                if !self.chunk.is_empty() && words + wanted > self.request_capacity {
                    break;
                }
                words += wanted;
                self.chunk.push(next);
                next += 1;
            }
            if self.chunk.is_empty() {
                continue;
            }
            let outcome = self
                .ensure_request_capacity(words)
                .and_then(|()| self.run_chunk(rows, words, out));
            if let Err(e) = outcome {
                for &i in &self.chunk {
                    out[i] = Err(SamplerError::Device {
                        message: e.to_string(),
                    });
                }
                self.broken = Some(e);
            }
        }
    }

    fn check(&self, rows: Rows<'_, '_>, i: usize) -> Result<(), SamplerError> {
        if let Some(broken) = &self.broken {
            return Err(SamplerError::Device {
                message: broken.to_string(),
            });
        }
        let len = match rows {
            Rows::Host(rows) => rows[i].logits.len(),
            Rows::Kept(rows) => match &self.kept {
                Some(kept) if rows[i].row < kept.rows => self.vocab_size,
                _ => {
                    return Err(SamplerError::Device {
                        message: format!("no kept logits row {}", rows[i].row),
                    })
                }
            },
        };
        let row = rows.request(i);
        check_row(len, row.params, row.history, row.mask)?;
        if len != self.vocab_size {
            return Err(SamplerError::VocabMismatch {
                expected: self.vocab_size,
                got: len,
            });
        }
        Ok(())
    }

    /// Grows the request buffers when one row's window and bias outgrow
    /// them: rare (a penalty window longer than the hint), never per token.
    fn ensure_request_capacity(&mut self, words: usize) -> Result<(), StepError> {
        if words <= self.request_capacity {
            return Ok(());
        }
        let capacity = words.next_power_of_two();
        tracing::debug!(
            words = capacity,
            "growing the GPU sampler's request buffers"
        );
        if !self.upload_mapped {
            self.wait_for_upload_mapping()?;
        }
        let device = &self.context.device;
        let (upload, requests) =
            Self::request_buffers(device, self.max_rows * self.vocab_size, capacity);
        self.bind_group = Self::bind_group(
            &self.context,
            &self.fixed,
            &self.logits,
            &requests,
            &self.results,
        );
        if let Some(kept) = &mut self.kept {
            kept.bind_group = Self::bind_group(
                &self.context,
                &self.fixed,
                &kept.buffer,
                &requests,
                &self.results,
            );
        }
        self.upload = upload;
        self.requests = requests;
        self.request_capacity = capacity;
        self.upload_mapped = true;
        Ok(())
    }

    /// Waits until the upload buffer's mapping, asked for at the end of the
    /// last step, has landed.
    fn wait_for_upload_mapping(&mut self) -> Result<(), StepError> {
        self.wait_for(&self.upload_state, "mapping the upload buffer")?;
        self.upload_mapped = true;
        Ok(())
    }

    /// Polls until a map callback has reported. Workers share the device,
    /// so another thread's poll may be running our callback when ours
    /// returns: poll again until it lands.
    fn wait_for(&self, state: &AtomicU8, what: &'static str) -> Result<(), StepError> {
        let started = Instant::now();
        loop {
            match state.load(Ordering::Acquire) {
                MAP_DONE => return Ok(()),
                MAP_FAILED => return Err(StepError::Map { what }),
                _ => {}
            }
            if started.elapsed() > STEP_TIMEOUT {
                return Err(StepError::TimedOut {
                    what,
                    after: STEP_TIMEOUT,
                });
            }
            self.context
                .device
                .poll(wgpu::PollType::Wait {
                    submission_index: None,
                    timeout: Some(STEP_TIMEOUT),
                })
                .map_err(|e| StepError::Poll {
                    what,
                    message: e.to_string(),
                })?;
            std::thread::yield_now();
        }
    }

    /// One dispatch over the rows in `self.chunk`.
    fn run_chunk(
        &mut self,
        rows: Rows<'_, '_>,
        words: usize,
        out: &mut [Result<Sampled, SamplerError>],
    ) -> Result<(), StepError> {
        if !self.upload_mapped {
            self.wait_for_upload_mapping()?;
        }
        self.write_upload(rows, words)?;
        let result_bytes = bytes(self.chunk.len() * RESULT_WORDS);
        let submission = self.submit_step(rows, words, result_bytes)?;
        self.map_for_next_step(submission, result_bytes)?;
        self.read_results(rows, result_bytes, out)
    }

    /// Packs the chunk's request words and writes them, after its logits
    /// rows (host rows only), into the mapped upload buffer; then unmaps it.
    fn write_upload(&mut self, rows: Rows<'_, '_>, words: usize) -> Result<(), StepError> {
        let row_bytes = self.vocab_size * 4;
        let logits_bytes = self.max_rows * row_bytes;
        self.words.clear();
        self.words.resize(words, 0);
        let mut tail = self.max_rows * PARAM_WORDS;
        for (slot, &i) in self.chunk.iter().enumerate() {
            let logits_row = rows.logits_row(i, slot);
            pack_row(
                &mut self.words,
                slot,
                logits_row,
                &mut tail,
                &rows.request(i),
            );
        }
        {
            let mut view =
                self.upload
                    .get_mapped_range_mut(..)
                    .map_err(|e| StepError::NotMapped {
                        buffer: "upload",
                        message: e.to_string(),
                    })?;
            if let Rows::Host(rows) = rows {
                for (slot, &i) in self.chunk.iter().enumerate() {
                    view.slice(slot * row_bytes..(slot + 1) * row_bytes)
                        .copy_from_slice(bytemuck::cast_slice(rows[i].logits));
                }
            }
            view.slice(logits_bytes..logits_bytes + words * 4)
                .copy_from_slice(bytemuck::cast_slice(&self.words));
        }
        self.upload.unmap();
        self.upload_mapped = false;
        Ok(())
    }

    /// Records and submits the step: the two copies in, one workgroup per
    /// row, and the copy of `result_bytes` of results out.
    fn submit_step(
        &self,
        rows: Rows<'_, '_>,
        words: usize,
        result_bytes: u64,
    ) -> Result<wgpu::SubmissionIndex, StepError> {
        let count = self.chunk.len();
        let row_bytes = self.vocab_size * 4;
        let logits_bytes = self.max_rows * row_bytes;
        let device = &self.context.device;
        let scope = device.push_error_scope(wgpu::ErrorFilter::Validation);
        let mut encoder = device.create_command_encoder(&wgpu::CommandEncoderDescriptor {
            label: Some("sampler step"),
        });
        let bind_group = match (rows, &self.kept) {
            (Rows::Host(_), _) => {
                encoder.copy_buffer_to_buffer(
                    &self.upload,
                    0,
                    &self.logits,
                    0,
                    (count * row_bytes) as u64,
                );
                &self.bind_group
            }
            (Rows::Kept(_), Some(kept)) => &kept.bind_group,
            (Rows::Kept(_), None) => {
                return Err(StepError::Validation("no kept logits are bound".into()))
            }
        };
        encoder.copy_buffer_to_buffer(
            &self.upload,
            logits_bytes as u64,
            &self.requests,
            0,
            bytes(words),
        );
        {
            let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some("sample_rows"),
                timestamp_writes: None,
            });
            pass.set_pipeline(&self.context.pipeline);
            pass.set_bind_group(0, bind_group, &[]);
            pass.dispatch_workgroups(count as u32, 1, 1);
        }
        encoder.copy_buffer_to_buffer(&self.results, 0, &self.readback, 0, result_bytes);
        let submission = match (rows, &self.kept) {
            // After the layers that computed the rows: one submission.
            (Rows::Kept(_), Some(kept)) => kept.device.submit_after_pending(encoder.finish()),
            _ => self.context.queue.submit([encoder.finish()]),
        };
        if let Some(error) = block_on(scope.pop()) {
            return Err(StepError::Validation(error.to_string()));
        }
        Ok(submission)
    }

    /// Asks for the readback mapping (the results) and the upload mapping
    /// (the next step's), waits for the submission, then for the results.
    fn map_for_next_step(
        &self,
        submission: wgpu::SubmissionIndex,
        result_bytes: u64,
    ) -> Result<(), StepError> {
        self.readback_state.store(MAP_PENDING, Ordering::Release);
        self.upload_state.store(MAP_PENDING, Ordering::Release);
        let readback_state = Arc::clone(&self.readback_state);
        self.readback
            .slice(..result_bytes)
            .map_async(wgpu::MapMode::Read, move |r| {
                readback_state.store(
                    if r.is_ok() { MAP_DONE } else { MAP_FAILED },
                    Ordering::Release,
                )
            });
        let upload_state = Arc::clone(&self.upload_state);
        self.upload
            .slice(..)
            .map_async(wgpu::MapMode::Write, move |r| {
                upload_state.store(
                    if r.is_ok() { MAP_DONE } else { MAP_FAILED },
                    Ordering::Release,
                )
            });
        self.context
            .device
            .poll(wgpu::PollType::Wait {
                submission_index: Some(submission),
                timeout: Some(STEP_TIMEOUT),
            })
            .map_err(|e| StepError::Poll {
                what: "the sampling step",
                message: e.to_string(),
            })?;
        self.wait_for(&self.readback_state, "reading the results back")
    }

    /// Each row's answer from the mapped readback buffer into `out`; then
    /// unmaps it.
    fn read_results(
        &self,
        rows: Rows<'_, '_>,
        result_bytes: u64,
        out: &mut [Result<Sampled, SamplerError>],
    ) -> Result<(), StepError> {
        {
            let view = self
                .readback
                .get_mapped_range(..result_bytes)
                .map_err(|e| StepError::NotMapped {
                    buffer: "readback",
                    message: e.to_string(),
                })?;
            let results: &[u32] = bytemuck::try_cast_slice(&view)
                .map_err(|e| StepError::Misaligned(e.to_string()))?;
            for (slot, &i) in self.chunk.iter().enumerate() {
                let result = &results[slot * RESULT_WORDS..(slot + 1) * RESULT_WORDS];
                let token = result[R_TOKEN];
                let status = result[R_STATUS];
                out[i] = match status {
                    STATUS_OK if (token as usize) < self.vocab_size => Ok(Sampled {
                        token,
                        logprobs: (rows.request(i).top_logprobs > 0).then(|| logprobs_from(result)),
                    }),
                    STATUS_NO_CANDIDATE => Err(SamplerError::NoCandidate {
                        vocab_size: self.vocab_size,
                    }),
                    _ => Err(SamplerError::Device {
                        message: format!("the shader answered token {token} with status {status}"),
                    }),
                };
            }
        }
        self.readback.unmap();
        Ok(())
    }
}

/// Why a sampling step on the device failed. The first one breaks the
/// sampler for good: every later row gets it as a `SamplerError::Device`.
#[derive(Clone, Debug, thiserror::Error)]
enum StepError {
    #[error("{what} failed")]
    Map { what: &'static str },
    #[error("{what} timed out after {after:?}")]
    TimedOut { what: &'static str, after: Duration },
    #[error("{what}: waiting for the device: {message}")]
    Poll { what: &'static str, message: String },
    #[error("the {buffer} buffer is not mapped: {message}")]
    NotMapped {
        buffer: &'static str,
        message: String,
    },
    #[error("the readback mapping is misaligned: {0}")]
    Misaligned(String),
    #[error("the device refused the step: {0}")]
    Validation(String),
}

/// Finishes a row's log-probability report as the CPU's `token_logprobs`
/// does: the shader hands over `logit - max` and the normaliser; the host
/// subtracts `ln(normaliser)` (or, with +inf logits, gives each -ln(count)).
fn logprobs_from(result: &[u32]) -> TokenLogprobs {
    let listed = (result[R_TOP_COUNT] as usize).min((result.len() - R_TOP) / 2);
    let pairs = result[R_TOP..R_TOP + 2 * listed].chunks_exact(2);
    let infinities = result[R_INFINITIES];
    if infinities > 0 {
        let each = -(infinities as f32).ln();
        return TokenLogprobs {
            token: result[R_TOKEN],
            chosen: each,
            top: pairs.map(|pair| (pair[0], each)).collect(),
        };
    }
    let log_normaliser = f32::from_bits(result[R_NORMALISER]).ln();
    // The shader's `logit - max` of the top token is -0.0 where the CPU's
    // is +0.0; adding +0.0 makes it +0.0 and changes nothing else, so a
    // lone candidate (a normaliser of 1) reports the CPU's +0.0 too.
    let logprob = |bits: u32| (f32::from_bits(bits) + 0.0) - log_normaliser;
    TokenLogprobs {
        token: result[R_TOKEN],
        chosen: logprob(result[R_CHOSEN]),
        top: pairs.map(|pair| (pair[0], logprob(pair[1]))).collect(),
    }
}
