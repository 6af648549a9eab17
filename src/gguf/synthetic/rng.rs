//! The seeded generator every synthetic weight is drawn from, and the name
//! hash that gives each tensor a stream of its own.

/// A small, fast, well-mixed generator; its stream is fixed forever so a
/// seed names the same model in every build.
pub(super) struct SplitMix64(u64);

impl SplitMix64 {
    pub(super) fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The stream of tensor `name` of the model seeded `seed`: independent
    /// of the other tensors and of their order, so a model cut to fewer
    /// layers has the same first layers.
    pub(super) fn for_tensor(seed: u64, name: &str) -> Self {
        Self::new(seed ^ fnv1a(name.as_bytes()))
    }

    pub(super) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub(super) fn next_unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }

    /// Uniform in [-1, 1).
    pub(super) fn next_signed_unit(&mut self) -> f32 {
        2.0 * self.next_unit() - 1.0
    }

    /// Uniform in `lo..=hi`.
    pub(super) fn next_in(&mut self, lo: u8, hi: u8) -> u8 {
        let span = u64::from(hi - lo) + 1;
        lo + (self.next_u64() % span) as u8
    }

    /// Fills `out` with random bytes, eight per draw.
    pub(super) fn fill(&mut self, out: &mut [u8]) {
        for chunk in out.chunks_mut(8) {
            let bytes = self.next_u64().to_le_bytes();
            chunk.copy_from_slice(&bytes[..chunk.len()]);
        }
    }
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xCBF2_9CE4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01B3)
    })
}
