//! Which block type each matrix gets: one type everywhere, or the choices
//! llama.cpp's quantizer makes for a file type, by the names it uses.
//!
//! The rules followed (llama-quantize's defaults, no importance matrix):
//! the output projection, or the embedding table when the output is tied
//! to it, is Q6_K for every quantized type but Q8_0, and Q8_0 when its rows
//! are not a multiple of 256; Q4_K_M and Q5_K_M store `attn_v` and
//! `ffn_down` as Q6_K in the first and last eighth of the layers and every
//! third layer between; IQ4_NL and IQ4_XS store `attn_v` as Q5_K when four
//! or more query heads share a KV head, and `ffn_down` as Q5_K in the first
//! eighth of the layers; and a 256-element type on rows that are not a
//! multiple of 256 falls back to a 32-element one (Q2_K, Q3_K and IQ4_XS
//! to IQ4_NL, Q4_K to Q5_0, Q5_K to Q5_1, Q6_K to Q8_0).

use super::blocks::WEIGHT_TYPES;
use crate::quant::{GgmlType, QK_K};

/// How the matrices of a synthetic model are stored. Norms, biases and
/// RoPE factors are always F32.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TypeRecipe {
    /// Every matrix exactly this type, no fallback and no special case:
    /// the rule of [`SyntheticLlama`](super::SyntheticLlama).
    Exact(GgmlType),
    /// Every matrix this type but the output projection (or the tied
    /// embedding table) and llama-quantize's special cases of the type's
    /// file type; rows that cannot hold its blocks fall back.
    Flat(GgmlType),
    /// Every matrix this type, the vocabulary matrices included (as
    /// llama-quantize `--pure`); rows that cannot hold its blocks fall back.
    Pure(GgmlType),
    /// llama-quantize's Q4_K_M (`Q4_K`) or Q5_K_M (`Q5_K`).
    Medium(GgmlType),
}

/// A matrix's place in the model, which the mixed recipes look at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Role {
    TokenEmbd,
    Output,
    AttnV,
    FfnDown,
    /// Q, K, attention output, gate, up.
    Other,
}

/// What the recipe needs to know of the model and the matrix.
pub(super) struct Place {
    pub role: Role,
    pub layer: usize,
    pub n_layers: usize,
    /// Query heads per KV head.
    pub gqa: usize,
    pub tied_output: bool,
    pub row_len: usize,
}

/// The names `inferd make-model --type` takes, as llama.cpp spells them.
pub const RECIPE_NAMES: [&str; 17] = [
    "f32", "f16", "bf16", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_k", "q3_k", "q4_k", "q5_k",
    "q6_k", "iq4_nl", "iq4_xs", "q4_k_m", "q5_k_m",
];

impl TypeRecipe {
    /// The recipe named `name` (any case): a block type's name is
    /// [`Flat`](Self::Flat) of it; `q4_k_m` and `q5_k_m` the mixed ones.
    pub fn from_name(name: &str) -> Option<Self> {
        let lower = name.to_ascii_lowercase();
        match lower.as_str() {
            "q4_k_m" => return Some(Self::Medium(GgmlType::Q4_K)),
            "q5_k_m" => return Some(Self::Medium(GgmlType::Q5_K)),
            _ => {}
        }
        WEIGHT_TYPES
            .into_iter()
            .find(|t| t.name().eq_ignore_ascii_case(&lower))
            .map(Self::Flat)
    }

    /// The name [`from_name`](Self::from_name) reads (`q4_k_m`, `q8_0`, ...).
    pub fn name(self) -> String {
        match self {
            Self::Medium(t) => format!("{}_m", t.name().to_ascii_lowercase()),
            Self::Exact(t) | Self::Flat(t) | Self::Pure(t) => t.name().to_ascii_lowercase(),
        }
    }

    /// The type most matrices get.
    pub fn base(self) -> GgmlType {
        match self {
            Self::Exact(t) | Self::Flat(t) | Self::Pure(t) | Self::Medium(t) => t,
        }
    }

    /// Whether the base type has a matrix kernel (and, for the mixed
    /// recipes, is one they are defined for).
    pub(super) fn is_supported(self) -> bool {
        match self {
            Self::Medium(t) => matches!(t, GgmlType::Q4_K | GgmlType::Q5_K),
            _ => WEIGHT_TYPES.contains(&self.base()),
        }
    }

    /// `general.file_type`, llama.cpp's number for the file's type
    /// (`LLAMA_FTYPE_*`; the single K-quant types count as their `_S`
    /// variant); none for [`Exact`](Self::Exact), whose files predate it.
    pub fn file_type(self) -> Option<u32> {
        use GgmlType as T;
        Some(match self {
            Self::Exact(_) => return None,
            Self::Medium(T::Q5_K) => 17,
            Self::Medium(_) => 15,
            Self::Flat(t) | Self::Pure(t) => match t {
                T::F32 => 0,
                T::F16 => 1,
                T::Q4_0 => 2,
                T::Q4_1 => 3,
                T::Q8_0 => 7,
                T::Q5_0 => 8,
                T::Q5_1 => 9,
                T::Q2_K => 10,
                T::Q3_K => 11,
                T::Q4_K => 14,
                T::Q5_K => 16,
                T::Q6_K => 18,
                T::IQ4_NL => 25,
                T::IQ4_XS => 30,
                T::BF16 => 32,
                _ => return None,
            },
        })
    }

    /// The type of the matrix at `place`.
    pub(super) fn tensor_type(self, place: &Place) -> GgmlType {
        let base = self.base();
        let chosen = match self {
            Self::Exact(t) => return t,
            Self::Pure(t) => t,
            Self::Flat(_) | Self::Medium(_) if !is_quantized(base) => base,
            Self::Flat(_) | Self::Medium(_) => special_case(self, place),
        };
        fallback(chosen, place.row_len)
    }
}

fn is_quantized(t: GgmlType) -> bool {
    !matches!(t, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16)
}

/// llama-quantize's choice for a quantized file type, before fallbacks.
fn special_case(recipe: TypeRecipe, p: &Place) -> GgmlType {
    let base = recipe.base();
    let iq4 = matches!(base, GgmlType::IQ4_NL | GgmlType::IQ4_XS);
    let medium = matches!(recipe, TypeRecipe::Medium(_));
    match p.role {
        Role::Output | Role::TokenEmbd if p.role == Role::Output || p.tied_output => {
            if !p.row_len.is_multiple_of(QK_K) || base == GgmlType::Q8_0 {
                GgmlType::Q8_0
            } else {
                GgmlType::Q6_K
            }
        }
        Role::AttnV if medium && more_bits(p.layer, p.n_layers) => GgmlType::Q6_K,
        Role::AttnV if iq4 && p.gqa >= 4 => GgmlType::Q5_K,
        Role::FfnDown if medium && more_bits(p.layer, p.n_layers) => GgmlType::Q6_K,
        Role::FfnDown if iq4 && p.layer < p.n_layers / 8 => GgmlType::Q5_K,
        _ => base,
    }
}

/// The layers a medium recipe gives more bits: the first and last eighth,
/// and every third layer between.
fn more_bits(layer: usize, n_layers: usize) -> bool {
    let eighth = n_layers / 8;
    layer < eighth || layer >= 7 * n_layers / 8 || (layer - eighth) % 3 == 2
}

/// A 32-element type for a 256-element one whose blocks the row cannot hold.
fn fallback(t: GgmlType, row_len: usize) -> GgmlType {
    if t.block_len() != QK_K || row_len.is_multiple_of(QK_K) {
        return t;
    }
    match t {
        GgmlType::Q4_K => GgmlType::Q5_0,
        GgmlType::Q5_K => GgmlType::Q5_1,
        GgmlType::Q6_K => GgmlType::Q8_0,
        _ => GgmlType::IQ4_NL,
    }
}
