//! Wall time per phase of the forward pass, summed over calls, for finding
//! where a many-thread prefill loses its time: `INFERD_PHASE_TIMES=1`
//! turns it on, `inferd bench` prints the table after its runs. The matrix
//! phase also sums its tasks' own times over every thread, so the table
//! tells waiting (tasks' sum well under wall time × threads) from slower
//! work per thread (the sum growing with the thread count). Off, a phase
//! costs one relaxed load.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Instant;

/// The timed parts of a layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// RMSNorms of the layer's input (and of Q and K per head).
    Norm,
    /// Activations quantized for a matrix.
    Quantize,
    /// The matrix kernels' region.
    Matmul,
    /// Every token's row gathered from the matrix tasks' chunks.
    Gather,
    /// RoPE and the query scale (on the calling thread).
    Rope,
    /// K and V written into the sessions' pages (on the calling thread).
    WriteKv,
    /// The attention region.
    Attention,
    /// The feed-forward activation.
    Activation,
    /// Biases, post-norms and the residual adds.
    Residual,
    /// Embedding and the logits (whole-call steps around the layers).
    Outside,
}

const PHASES: [Phase; 10] = [
    Phase::Norm,
    Phase::Quantize,
    Phase::Matmul,
    Phase::Gather,
    Phase::Rope,
    Phase::WriteKv,
    Phase::Attention,
    Phase::Activation,
    Phase::Residual,
    Phase::Outside,
];

static WALL_NANOS: [AtomicU64; PHASES.len()] = [const { AtomicU64::new(0) }; PHASES.len()];
/// The matrix tasks' own times, summed over every thread.
static MATMUL_TASK_NANOS: AtomicU64 = AtomicU64::new(0);

/// Whether `INFERD_PHASE_TIMES=1` was set when first asked.
pub fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("INFERD_PHASE_TIMES").is_some_and(|v| v == "1"))
}

/// Adds the time until it is dropped to its phase.
pub struct PhaseTimer(Option<(Phase, Instant)>);

/// Times `phase` until the returned guard is dropped (nothing when off).
#[inline]
pub fn time(phase: Phase) -> PhaseTimer {
    PhaseTimer(enabled().then(|| (phase, Instant::now())))
}

impl Drop for PhaseTimer {
    fn drop(&mut self) {
        if let Some((phase, t0)) = self.0 {
            WALL_NANOS[phase as usize].fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        }
    }
}

/// Times one matrix task on whichever thread runs it (nothing when off).
#[inline]
pub fn time_matmul_task() -> MatmulTaskTimer {
    MatmulTaskTimer(enabled().then(Instant::now))
}

/// Adds the time until it is dropped to the matrix tasks' sum.
pub struct MatmulTaskTimer(Option<Instant>);

impl Drop for MatmulTaskTimer {
    fn drop(&mut self) {
        if let Some(t0) = self.0 {
            MATMUL_TASK_NANOS.fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        }
    }
}

/// Zeroes every sum.
pub fn reset() {
    for n in &WALL_NANOS {
        n.store(0, Ordering::Relaxed);
    }
    MATMUL_TASK_NANOS.store(0, Ordering::Relaxed);
}

/// The sums as a table: each phase's wall time and share, then the matrix
/// tasks' sum against the matrix wall time times `threads`.
pub fn report(threads: usize) -> String {
    let nanos: Vec<u64> = WALL_NANOS
        .iter()
        .map(|n| n.load(Ordering::Relaxed))
        .collect();
    let total: u64 = nanos.iter().sum::<u64>().max(1);
    let mut out = String::from("phase         wall ms   share\n");
    for (phase, &ns) in PHASES.iter().zip(&nanos) {
        out.push_str(&format!(
            "{:<12} {:>9.1} {:>6.1}%\n",
            format!("{phase:?}"),
            ns as f64 / 1e6,
            100.0 * ns as f64 / total as f64
        ));
    }
    let tasks = MATMUL_TASK_NANOS.load(Ordering::Relaxed);
    let matmul = nanos[Phase::Matmul as usize].max(1);
    out.push_str(&format!(
        "matmul tasks {:>9.1} ms summed over threads: {:.1}% of {} threads x matmul wall\n",
        tasks as f64 / 1e6,
        100.0 * tasks as f64 / (matmul as f64 * threads as f64),
        threads
    ));
    out
}
