//! One opened adapter for the model: device, queue and the adapter's real
//! limits, with the blocking helpers the backend needs (compile, read back).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use futures_executor::block_on;

use super::adapter::{self, describe, AdapterKind};
use super::GpuError;

/// Most KV buffers one attention kernel binds (the cache holds this many
/// times what one binding can).
pub const MAX_KV_BINDINGS: usize = 4;

/// How long one submission may run before it counts as lost.
pub const STEP_TIMEOUT: Duration = Duration::from_secs(60);

/// The device the model's buffers and kernels live on.
pub struct GpuDevice {
    info: wgpu::AdapterInfo,
    pub(crate) device: wgpu::Device,
    pub(crate) queue: wgpu::Queue,
    limits: wgpu::Limits,
    /// The smallest subgroup the adapter runs, when the kernels use
    /// subgroup shuffles (see [`GpuDevice::subgroups`]).
    subgroup_min: Option<u32>,
    /// Recorded work not yet submitted (a decode step's layers, waiting
    /// for the sampler's dispatch to go with them); every submission on
    /// the device sends it first, so the queue runs work in the order it
    /// was recorded.
    pending: Mutex<Vec<wgpu::CommandBuffer>>,
    submissions: AtomicU64,
}

impl std::fmt::Debug for GpuDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuDevice")
            .field("adapter", &self.describe())
            .finish()
    }
}

impl GpuDevice {
    /// Opens the best adapter of the wanted kind with every limit it has
    /// (wgpu's defaults would cap a binding at 128 MiB), using subgroups
    /// where the adapter has them unless `INFERD_GPU_SUBGROUPS=0`.
    pub fn open(kind: AdapterKind) -> Result<Arc<Self>, GpuError> {
        let subgroups = std::env::var("INFERD_GPU_SUBGROUPS").map_or(true, |v| v != "0");
        Self::open_with(kind, subgroups)
    }

    /// [`GpuDevice::open`], with subgroups used only when `subgroups` is
    /// set and the adapter has them (the kernels give the same bits either
    /// way).
    pub fn open_with(kind: AdapterKind, subgroups: bool) -> Result<Arc<Self>, GpuError> {
        let adapter = adapter::choose(kind).map_err(|e| GpuError::NoAdapter { seen: e.seen })?;
        let info = adapter.get_info();
        let limits = adapter.limits();
        // The shuffle levels of a reduction tree assume subgroups of a
        // power of two no wider than the 64-lane workgroups.
        let subgroup_min = (subgroups
            && adapter.features().contains(wgpu::Features::SUBGROUP)
            && info.subgroup_min_size.is_power_of_two()
            && info.subgroup_max_size <= 64)
            .then_some(info.subgroup_min_size);
        let required_features = if subgroup_min.is_some() {
            wgpu::Features::SUBGROUP
        } else {
            wgpu::Features::empty()
        };
        let (device, queue) = block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("inferd model"),
            required_features,
            required_limits: limits.clone(),
            ..Default::default()
        }))
        .map_err(|e| GpuError::Device {
            adapter: describe(&info),
            message: e.to_string(),
        })?;
        // Errors inside a step are caught by error scopes; anything else is
        // logged rather than panicking a worker thread.
        device.on_uncaptured_error(Arc::new(|error: wgpu::Error| {
            tracing::error!(%error, "wgpu model error");
        }));
        tracing::info!(
            adapter = %describe(&info),
            subgroups = ?subgroup_min,
            "GPU device opened"
        );
        Ok(Arc::new(Self {
            info,
            device,
            queue,
            limits,
            subgroup_min,
            pending: Mutex::new(Vec::new()),
            submissions: AtomicU64::new(0),
        }))
    }

    /// The adapter's name, backend, kind and driver.
    pub fn describe(&self) -> String {
        describe(&self.info)
    }

    /// Whether the adapter is a real GPU (not lavapipe or another CPU one).
    pub fn is_hardware(&self) -> bool {
        adapter::is_hardware(self.info.device_type)
    }

    /// The adapter the device was opened on.
    pub fn info(&self) -> &wgpu::AdapterInfo {
        &self.info
    }

    /// The smallest subgroup size, when the kernels use subgroups: below it
    /// a reduction tree's levels are shuffles inside one subgroup instead
    /// of workgroup-memory steps with a barrier each.
    pub fn subgroups(&self) -> Option<u32> {
        self.subgroup_min
    }

    /// The limits the device was opened with (the adapter's own).
    pub fn limits(&self) -> &wgpu::Limits {
        &self.limits
    }

    /// KV buffers an attention kernel binds: as many as the adapter lets a
    /// kernel hold beside the six other storage buffers it reads, at most
    /// [`MAX_KV_BINDINGS`].
    pub fn kv_bindings(&self) -> usize {
        (self.limits.max_storage_buffers_per_shader_stage as usize)
            .saturating_sub(6)
            .clamp(1, MAX_KV_BINDINGS)
    }

    /// Largest byte range one storage binding may cover, as a multiple of
    /// 16 so that any part of a split tensor starts aligned.
    pub fn max_binding_bytes(&self) -> u64 {
        let binding = self.limits.max_storage_buffer_binding_size;
        binding.min(self.limits.max_buffer_size) & !15
    }

    /// Compiles `source` and builds the pipeline of its `entry` point,
    /// turning validation failures into an error instead of a log line.
    pub(crate) fn pipeline(
        &self,
        label: &str,
        source: &str,
        entry: &str,
        layout: &wgpu::PipelineLayout,
    ) -> Result<wgpu::ComputePipeline, GpuError> {
        let [pipeline] = self.build_pipelines(label, source, [entry], Some(layout))?;
        Ok(pipeline)
    }

    /// Compiles `source` once and builds a pipeline per entry point, each
    /// with the layout the shader implies.
    pub(crate) fn auto_pipelines<const N: usize>(
        &self,
        label: &str,
        source: &str,
        entries: [&str; N],
    ) -> Result<[wgpu::ComputePipeline; N], GpuError> {
        self.build_pipelines(label, source, entries, None)
    }

    /// Runs `make` (buffers created, uploads queued), applies its uploads
    /// and waits for them, so that the device running out of memory or
    /// refusing a buffer is an error naming `what` rather than a log line
    /// and a device that fails later.
    pub fn allocating<T>(&self, what: &str, make: impl FnOnce() -> T) -> Result<T, GpuError> {
        let out_of_memory = self.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let invalid = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let made = make();
        let applied = self.submit(self.encoder("uploads"));
        let invalid = block_on(invalid.pop());
        let out_of_memory = block_on(out_of_memory.pop());
        if let Some(error) = out_of_memory.or(invalid) {
            return Err(GpuError::Allocation {
                what: what.to_string(),
                adapter: self.describe(),
                message: error.to_string(),
            });
        }
        applied.map(|()| made)
    }

    fn build_pipelines<const N: usize>(
        &self,
        label: &str,
        source: &str,
        entries: [&str; N],
        layout: Option<&wgpu::PipelineLayout>,
    ) -> Result<[wgpu::ComputePipeline; N], GpuError> {
        let scope = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let module = self
            .device
            .create_shader_module(wgpu::ShaderModuleDescriptor {
                label: Some(label),
                source: wgpu::ShaderSource::Wgsl(source.into()),
            });
        let pipelines = entries.map(|entry| {
            self.device
                .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                    label: Some(entry),
                    layout,
                    module: &module,
                    entry_point: Some(entry),
                    compilation_options: wgpu::PipelineCompilationOptions::default(),
                    cache: None,
                })
        });
        match block_on(scope.pop()) {
            None => Ok(pipelines),
            Some(error) => Err(GpuError::Pipeline {
                adapter: self.describe(),
                kernel: label.to_string(),
                message: error.to_string(),
            }),
        }
    }

    /// Submits `encoder` (after any deferred work) and waits for it to
    /// finish.
    pub fn submit(&self, encoder: wgpu::CommandEncoder) -> Result<(), GpuError> {
        let submission = self.submit_after_pending(encoder.finish());
        self.wait(submission)
    }

    /// Waits for `submission` to finish.
    pub(crate) fn wait(&self, submission: wgpu::SubmissionIndex) -> Result<(), GpuError> {
        self.device
            .poll(wgpu::PollType::Wait {
                submission_index: Some(submission),
                timeout: Some(STEP_TIMEOUT),
            })
            .map(|_| ())
            .map_err(|e| GpuError::Lost {
                what: "waiting for a submission",
                message: e.to_string(),
            })
    }

    /// Holds `encoder`'s work back to go out with the next submission on
    /// this device, so that a decode step's layers and its sampling are
    /// one submission.
    pub fn defer(&self, encoder: wgpu::CommandEncoder) {
        self.pending().push(encoder.finish());
    }

    /// Submits the deferred work, if any, without waiting. Whoever queues
    /// a buffer write that deferred work may touch calls this first: a
    /// queued write runs before every command buffer of the submission it
    /// goes out with.
    pub fn flush(&self) {
        let mut pending = self.pending();
        if !pending.is_empty() {
            self.queue.submit(pending.drain(..));
            self.submissions.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Submits the deferred work and `commands` as one submission.
    pub fn submit_after_pending(&self, commands: wgpu::CommandBuffer) -> wgpu::SubmissionIndex {
        let mut pending = self.pending();
        let submission = self
            .queue
            .submit(pending.drain(..).chain(std::iter::once(commands)));
        self.submissions.fetch_add(1, Ordering::Relaxed);
        submission
    }

    /// Submissions made on this device so far.
    pub fn submissions(&self) -> u64 {
        self.submissions.load(Ordering::Relaxed)
    }

    fn pending(&self) -> MutexGuard<'_, Vec<wgpu::CommandBuffer>> {
        // A panic while holding the list leaves it whole: keep using it.
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Copies `len` f32 values from the start of `buffer` back to the host
    /// (for tests and checks; the step itself reads back only token ids).
    pub fn read_f32(&self, buffer: &wgpu::Buffer, len: usize) -> Result<Vec<f32>, GpuError> {
        let bytes = self.read_bytes(buffer, 0, len * 4)?;
        Ok(bytemuck::pod_collect_to_vec(&bytes))
    }

    /// Copies `len` bytes at `offset` of `buffer` back to the host.
    pub(crate) fn read_bytes(
        &self,
        buffer: &wgpu::Buffer,
        offset: u64,
        len: usize,
    ) -> Result<Vec<u8>, GpuError> {
        let padded = (len as u64).div_ceil(4) * 4;
        if padded == 0 {
            return Ok(Vec::new());
        }
        let staging = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("readback"),
            size: padded,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let mut encoder = self.encoder("readback");
        encoder.copy_buffer_to_buffer(buffer, offset, &staging, 0, padded);
        self.submit(encoder)?;
        let words = self.map_read(&staging, padded)?;
        let mut bytes: Vec<u8> = bytemuck::cast_slice(&words).to_vec();
        bytes.truncate(len);
        Ok(bytes)
    }

    /// Maps the first `bytes` of a `MAP_READ` buffer whose writes were
    /// submitted, copies them out as f32 and unmaps it.
    pub(crate) fn map_read(&self, buffer: &wgpu::Buffer, bytes: u64) -> Result<Vec<f32>, GpuError> {
        let lost = |message: String| GpuError::Lost {
            what: "mapping a readback buffer",
            message,
        };
        let (tx, rx) = std::sync::mpsc::channel();
        buffer
            .slice(..bytes)
            .map_async(wgpu::MapMode::Read, move |r| {
                let _ = tx.send(r);
            });
        self.device
            .poll(wgpu::PollType::Wait {
                submission_index: None,
                timeout: Some(STEP_TIMEOUT),
            })
            .map_err(|e| lost(e.to_string()))?;
        match rx.recv_timeout(STEP_TIMEOUT) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(lost(e.to_string())),
            Err(_) => return Err(lost("the mapping never completed".into())),
        }
        let values = buffer
            .get_mapped_range(..bytes)
            .map(|view| bytemuck::cast_slice(&view).to_vec())
            .map_err(|e| lost(e.to_string()));
        buffer.unmap();
        values
    }

    /// A storage buffer holding `bytes`, padded with zeros to a multiple of
    /// four bytes plus one word, so that a kernel reading an unaligned
    /// 32-bit value at the last byte stays inside the buffer.
    pub(crate) fn storage_with(&self, label: &str, bytes: &[u8]) -> wgpu::Buffer {
        let size = (bytes.len() as u64).div_ceil(4) * 4 + 4;
        let buffer = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size,
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        self.write_bytes(&buffer, bytes);
        buffer
    }

    /// Queues `bytes` to be written at the start of `buffer` (applied at
    /// the next submission), a tail that is not whole words padded with
    /// zeros as copies require.
    pub(crate) fn write_bytes(&self, buffer: &wgpu::Buffer, bytes: &[u8]) {
        self.flush();
        let whole = bytes.len() / 4 * 4;
        if whole > 0 {
            self.queue.write_buffer(buffer, 0, &bytes[..whole]);
        }
        if whole < bytes.len() {
            let mut tail = [0u8; 4];
            tail[..bytes.len() - whole].copy_from_slice(&bytes[whole..]);
            self.queue.write_buffer(buffer, whole as u64, &tail);
        }
    }

    /// A zeroed storage buffer of `bytes` (rounded up to a word) that can
    /// also be copied from and to.
    pub fn storage(&self, label: &str, bytes: u64) -> wgpu::Buffer {
        self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size: bytes.div_ceil(4).max(1) * 4,
            usage: wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_DST
                | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        })
    }

    /// A uniform buffer holding `words`.
    pub fn uniform_words(&self, label: &str, words: &[u32]) -> wgpu::Buffer {
        let buffer = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size: (words.len() as u64 * 4).max(16),
            usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        self.queue
            .write_buffer(&buffer, 0, bytemuck::cast_slice(words));
        buffer
    }

    /// A command encoder on this device.
    pub fn encoder(&self, label: &str) -> wgpu::CommandEncoder {
        self.device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some(label) })
    }

    /// Writes `values` at the start of `buffer`.
    pub fn write_f32(&self, buffer: &wgpu::Buffer, values: &[f32]) {
        self.flush();
        self.queue
            .write_buffer(buffer, 0, bytemuck::cast_slice(values));
    }
}
