//! Which shard runs which layers: the `--shards` entries, the plan that
//! places them over the model, and the start-up probe of every shard.

use std::ops::Range;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use grpcio::Environment;

use super::ShardStats;
use crate::cluster::fingerprint::Fingerprint;
use crate::cluster::link::{LinkError, LinkOptions, ShardCapacity, ShardLink};
use crate::cluster::payload::Encoding;

/// A handshake that takes longer than this counts as a failed connect.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(3);

/// `A..B` with A < B: layers A to B-1.
pub fn parse_layers(text: &str) -> Result<Range<usize>, String> {
    let (a, b) = text
        .split_once("..")
        .ok_or_else(|| format!("{text:?} is not a range like 0..15"))?;
    let start: usize = a
        .trim()
        .parse()
        .map_err(|_| format!("{a:?} is not a layer number"))?;
    let end: usize = b
        .trim()
        .parse()
        .map_err(|_| format!("{b:?} is not a layer number"))?;
    if start >= end {
        return Err(format!("{text}: the range is empty (it is half-open)"));
    }
    Ok(start..end)
}

/// One `--shards` entry: `ADDR`, or `ADDR=A..B` to name the layer range.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardSpec {
    pub addr: String,
    pub layers: Option<Range<usize>>,
}

impl ShardSpec {
    /// Parses one entry.
    pub fn parse(text: &str) -> Result<ShardSpec, String> {
        let text = text.trim();
        let (addr, layers) = match text.split_once('=') {
            Some((addr, range)) => (addr.trim(), Some(parse_layers(range)?)),
            None => (text, None),
        };
        if addr.is_empty() {
            return Err(format!("{text:?}: a shard needs an address (HOST:PORT)"));
        }
        Ok(ShardSpec {
            addr: addr.to_owned(),
            layers,
        })
    }

    /// Parses a comma-separated list.
    pub fn parse_list(text: &str) -> Result<Vec<ShardSpec>, String> {
        text.split(',')
            .filter(|s| !s.trim().is_empty())
            .map(ShardSpec::parse)
            .collect()
    }
}

/// Why a list of shards cannot run the model.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error("no shards listed")]
    Empty,
    #[error("{shards} shards for a model of {layers} layers: each shard needs at least one")]
    TooMany { shards: usize, layers: usize },
    #[error("either every shard names its layers (ADDR=A..B) or none does")]
    Mixed,
    #[error(
        "the shards' layers must run 0..{layers} in order without gaps; \
         shard {index} starts at {start}, expected {expected}"
    )]
    Gap {
        index: usize,
        start: usize,
        expected: usize,
        layers: usize,
    },
    #[error("the last shard ends at layer {end}, the model has {layers}")]
    Short { end: usize, layers: usize },
}

/// Why the shards cannot be used at start-up.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// The shard refused the handshake, or stayed unreachable (the
    /// error names it).
    #[error(transparent)]
    Link(#[from] LinkError),
    #[error("shard {shard} did not say how much KV it holds")]
    NoCapacity { shard: String },
    #[error(
        "shard {shard} pages {theirs} positions, another {others}: every shard must page alike"
    )]
    PagingDiffers {
        shard: String,
        theirs: u32,
        others: u32,
    },
}

/// A shard and what it must serve.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlannedShard {
    pub addr: String,
    pub fingerprint: Fingerprint,
}

impl PlannedShard {
    /// `ADDR (layers A..B)`, for messages and metric labels.
    pub fn label(&self) -> String {
        format!(
            "{} (layers {}..{})",
            self.addr, self.fingerprint.layer_begin, self.fingerprint.layer_end
        )
    }
}

/// Which shard runs which layers, the terms every link asks for, the
/// coordinator's epoch, the counters every worker adds to, and the gRPC
/// completion queues every link shares.
pub struct ShardPlan {
    pub(super) shards: Vec<PlannedShard>,
    pub(super) options: LinkOptions,
    pub(super) coordinator_epoch: u64,
    pub(super) stats: Arc<ShardStats>,
    pub(super) env: Arc<Environment>,
}

impl std::fmt::Debug for ShardPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardPlan")
            .field("shards", &self.shards)
            .field("options", &self.options)
            .field("coordinator_epoch", &self.coordinator_epoch)
            .finish_non_exhaustive()
    }
}

impl ShardPlan {
    /// Places `specs` over the model's layers: ranges as named, or, when
    /// none is named, split as evenly as whole layers allow, in list order
    /// (shard `i` of `k` runs `i*n/k .. (i+1)*n/k`).
    pub fn new(
        n_layers: usize,
        hidden_size: usize,
        gguf_sha256: [u8; 32],
        specs: &[ShardSpec],
        encoding: Encoding,
    ) -> Result<ShardPlan, PlanError> {
        let n = n_layers;
        let k = specs.len();
        if k == 0 {
            return Err(PlanError::Empty);
        }
        if k > n {
            return Err(PlanError::TooMany {
                shards: k,
                layers: n,
            });
        }
        let named = specs.iter().filter(|s| s.layers.is_some()).count();
        let ranges: Vec<Range<usize>> = if named == 0 {
            (0..k).map(|i| i * n / k..(i + 1) * n / k).collect()
        } else if named == k {
            specs.iter().filter_map(|s| s.layers.clone()).collect()
        } else {
            return Err(PlanError::Mixed);
        };
        let mut expected = 0;
        for (index, r) in ranges.iter().enumerate() {
            if r.start != expected || r.end <= r.start {
                return Err(PlanError::Gap {
                    index,
                    start: r.start,
                    expected,
                    layers: n,
                });
            }
            expected = r.end;
        }
        if expected != n {
            return Err(PlanError::Short {
                end: expected,
                layers: n,
            });
        }
        let shards: Vec<PlannedShard> = specs
            .iter()
            .zip(ranges)
            .map(|(spec, r)| PlannedShard {
                addr: spec.addr.clone(),
                fingerprint: Fingerprint {
                    gguf_sha256,
                    layer_begin: r.start as u32,
                    layer_end: r.end as u32,
                    layer_count: n as u32,
                    hidden_size: hidden_size as u32,
                },
            })
            .collect();
        let stats = Arc::new(ShardStats::new(&shards));
        Ok(ShardPlan {
            shards,
            options: LinkOptions {
                encoding,
                handshake_timeout: HANDSHAKE_TIMEOUT,
                ..LinkOptions::default()
            },
            coordinator_epoch: crate::cluster::shard::random_epoch(),
            stats,
            // The workers block on their links; these threads only move
            // bytes.
            env: Arc::new(Environment::new(2)),
        })
    }

    pub fn shards(&self) -> &[PlannedShard] {
        &self.shards
    }

    pub fn encoding(&self) -> Encoding {
        self.options.encoding
    }

    pub fn coordinator_epoch(&self) -> u64 {
        self.coordinator_epoch
    }

    pub fn stats(&self) -> &Arc<ShardStats> {
        &self.stats
    }

    /// Handshakes with every shard once (each must serve its fingerprint)
    /// and returns what all of them can hold: the fewest pages and
    /// sessions. Shards must agree on positions per page. A shard that
    /// cannot be reached yet (hosts start in any order) is tried again for
    /// up to `wait`; a shard that refuses the handshake fails at once.
    pub fn probe(&self, wait: Duration) -> Result<ShardCapacity, ProbeError> {
        let give_up = Instant::now() + wait;
        let mut least: Option<ShardCapacity> = None;
        let mut backends = Vec::with_capacity(self.shards.len());
        for (shard, counters) in self.shards.iter().zip(&self.stats.shards) {
            let mut next_warning = Instant::now();
            let link = loop {
                let connected = ShardLink::connect_in(
                    &self.env,
                    &shard.addr,
                    &shard.fingerprint,
                    self.coordinator_epoch,
                    &self.options,
                );
                match connected {
                    Ok(link) => break link,
                    Err(e @ LinkError::Transport { .. }) if Instant::now() < give_up => {
                        if Instant::now() >= next_warning {
                            tracing::warn!(shard = %shard.label(), error = %e, "waiting for the shard");
                            next_warning = Instant::now() + Duration::from_secs(5);
                        }
                        std::thread::sleep(Duration::from_millis(250));
                    }
                    Err(e) => return Err(ProbeError::Link(e)),
                }
            };
            counters.up.store(true, Ordering::Relaxed);
            let c = link.capacity();
            counters.set_backend(c.backend);
            backends.push(format!("{} on the {}", shard.label(), c.backend.name()));
            if c.kv_pages == 0 || c.page_positions == 0 {
                return Err(ProbeError::NoCapacity {
                    shard: shard.label(),
                });
            }
            least = Some(match least {
                None => c,
                Some(l) if l.page_positions != c.page_positions => {
                    return Err(ProbeError::PagingDiffers {
                        shard: shard.label(),
                        theirs: c.page_positions,
                        others: l.page_positions,
                    })
                }
                Some(l) => ShardCapacity {
                    kv_pages: l.kv_pages.min(c.kv_pages),
                    page_positions: l.page_positions,
                    max_sessions: match (l.max_sessions, c.max_sessions) {
                        (0, m) | (m, 0) => m,
                        (a, b) => a.min(b),
                    },
                    max_frame_rows: match (l.max_frame_rows, c.max_frame_rows) {
                        (0, m) | (m, 0) => m,
                        (a, b) => a.min(b),
                    },
                    keeps_pages: l.keeps_pages && c.keeps_pages,
                    backend: l.backend,
                },
            });
        }
        let differ = self
            .stats
            .shards
            .windows(2)
            .any(|w| w[0].backend() != w[1].backend());
        if differ {
            tracing::warn!(
                shards = %backends.join(", "),
                "the shards compute on different backends: they agree closely, not bit for bit, \
                 so logits digests match only runs with the same shards on the same backends"
            );
        } else {
            tracing::info!(shards = %backends.join(", "), "shards handshaken");
        }
        least.ok_or(ProbeError::Plan(PlanError::Empty))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_entries_name_an_address_and_maybe_a_range() {
        assert_eq!(
            ShardSpec::parse("10.0.0.2:7000"),
            Ok(ShardSpec {
                addr: "10.0.0.2:7000".into(),
                layers: None
            })
        );
        assert_eq!(
            ShardSpec::parse(" h:1=0..15 "),
            Ok(ShardSpec {
                addr: "h:1".into(),
                layers: Some(0..15)
            })
        );
        assert!(ShardSpec::parse("=0..3").is_err());
        assert!(ShardSpec::parse("h:1=3..3").is_err());
        assert_eq!(ShardSpec::parse_list("a:1, b:2,").map(|l| l.len()), Ok(2));
    }

    #[test]
    fn layer_ranges_are_half_open_and_non_empty() {
        assert_eq!(parse_layers("0..15"), Ok(0..15));
        assert_eq!(parse_layers(" 3 .. 4"), Ok(3..4));
        assert!(parse_layers("5..5").is_err());
        assert!(parse_layers("7..2").is_err());
        assert!(parse_layers("a..2").is_err());
        assert!(parse_layers("12").is_err());
    }

    fn plan(specs: &str, layers: usize) -> Result<Vec<(u32, u32)>, PlanError> {
        let specs = ShardSpec::parse_list(specs).expect("parses");
        ShardPlan::new(layers, 8, [0; 32], &specs, Encoding::F32).map(|p| {
            p.shards()
                .iter()
                .map(|s| (s.fingerprint.layer_begin, s.fingerprint.layer_end))
                .collect()
        })
    }

    #[test]
    fn unnamed_ranges_split_the_layers_evenly_in_order() {
        assert_eq!(plan("a:1,b:1", 30), Ok(vec![(0, 15), (15, 30)]));
        assert_eq!(
            plan("a:1,b:1,c:1", 30),
            Ok(vec![(0, 10), (10, 20), (20, 30)])
        );
        assert_eq!(plan("a:1,b:1,c:1", 4), Ok(vec![(0, 1), (1, 2), (2, 4)]));
        assert_eq!(plan("a:1", 4), Ok(vec![(0, 4)]));
    }

    #[test]
    fn named_ranges_must_tile_the_model() {
        assert_eq!(plan("a:1=0..3,b:1=3..30", 30), Ok(vec![(0, 3), (3, 30)]));
        assert!(matches!(
            plan("a:1=0..3,b:1=4..30", 30),
            Err(PlanError::Gap { index: 1, .. })
        ));
        assert!(matches!(
            plan("a:1=1..30", 30),
            Err(PlanError::Gap { index: 0, .. })
        ));
        assert_eq!(
            plan("a:1=0..29", 30),
            Err(PlanError::Short {
                end: 29,
                layers: 30
            })
        );
        assert_eq!(plan("a:1=0..3,b:1", 30), Err(PlanError::Mixed));
        assert_eq!(plan("", 30), Err(PlanError::Empty));
        assert!(matches!(
            plan("a:1,b:1,c:1", 2),
            Err(PlanError::TooMany { .. })
        ));
    }
}
