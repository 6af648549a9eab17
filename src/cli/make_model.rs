//! `inferd make-model`: a random-weight model of a real checkpoint's shape,
//! written by inferd alone, for machines that cannot download one.
//!
//! The file is streamed to disk tensor by tensor (a 7B model never sits in
//! memory), under a temporary name renamed into place once it is whole, so
//! an interrupted run leaves no file that looks finished.

use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use clap::builder::PossibleValuesParser;
use clap::Args;

use super::CliError;
use crate::gguf::synthetic::{SyntheticModel, TypeRecipe, WriteError, NAMED_SHAPES, RECIPE_NAMES};

#[derive(Debug, Args)]
pub struct MakeModelArgs {
    /// The checkpoint whose shape and metadata the model has.
    #[arg(long, value_parser = PossibleValuesParser::new(NAMED_SHAPES.map(|s| s.name)))]
    pub shape: String,
    /// How the matrices are stored, as llama.cpp names the types: a block
    /// type (the output matrix and a few others as llama-quantize stores
    /// them for that type), or the mixed q4_k_m / q5_k_m.
    #[arg(long = "type", value_name = "TYPE", value_parser = PossibleValuesParser::new(RECIPE_NAMES), ignore_case = true)]
    pub recipe: String,
    /// Store every matrix, output and embeddings included, as --type
    /// (llama-quantize --pure); rows its blocks do not fit still fall back.
    #[arg(long)]
    pub pure: bool,
    /// Layers [default: the checkpoint's].
    #[arg(long)]
    pub layers: Option<usize>,
    /// Vocabulary size [default: the checkpoint's]; the tokens are
    /// synthetic byte-level ones either way.
    #[arg(long)]
    pub vocab: Option<usize>,
    /// Seed of the weights: the same seed, shape and type give the same file.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Where to write the GGUF file.
    #[arg(long, short = 'o', value_name = "FILE")]
    pub out: PathBuf,
}

pub fn run(args: MakeModelArgs) -> Result<(), CliError> {
    let model = model(&args)?;
    let n_tensors = model.tensor_specs().map_err(usage)?.len();
    let partial = partial_path(&args.out);
    let written = write(&model, &partial).and_then(|len| {
        std::fs::rename(&partial, &args.out)?;
        Ok(len)
    });
    let len = match written {
        Ok(len) => len,
        Err(e) => {
            // What was written is no model; the error is what matters.
            let _ = std::fs::remove_file(&partial);
            return Err(e);
        }
    };
    println!(
        "wrote {}: {} ({} layers, {}{}), {n_tensors} tensors, {len} bytes ({:.1} MiB)",
        args.out.display(),
        args.shape,
        model.shape.n_layers,
        model.recipe.name(),
        if args.pure { ", pure" } else { "" },
        len as f64 / (1u64 << 20) as f64,
    );
    Ok(())
}

/// The model the flags describe, checked.
fn model(args: &MakeModelArgs) -> Result<SyntheticModel, CliError> {
    let recipe = TypeRecipe::from_name(&args.recipe)
        .ok_or_else(|| CliError::Usage(format!("--type {}: unknown type", args.recipe)))?;
    let recipe = if args.pure {
        match recipe {
            TypeRecipe::Medium(_) => {
                return Err(CliError::Usage(format!(
                    "--pure takes a single block type, not the mixed {}",
                    args.recipe
                )))
            }
            r => TypeRecipe::Pure(r.base()),
        }
    } else {
        recipe
    };
    let mut model = SyntheticModel::named(&args.shape, recipe, args.seed).map_err(usage)?;
    if let Some(layers) = args.layers {
        model.shape.n_layers = layers;
    }
    if let Some(vocab) = args.vocab {
        model.shape.vocab = vocab;
    }
    model.validate().map_err(usage)?;
    Ok(model)
}

fn usage(e: impl std::fmt::Display) -> CliError {
    CliError::Usage(e.to_string())
}

/// `FILE.partial` beside `out`.
fn partial_path(out: &Path) -> PathBuf {
    let mut name = out.file_name().unwrap_or_default().to_os_string();
    name.push(".partial");
    out.with_file_name(name)
}

fn write(model: &SyntheticModel, path: &Path) -> Result<u64, CliError> {
    let file = std::fs::File::create(path).map_err(|e| io_at(path, e))?;
    let mut out = BufWriter::with_capacity(1 << 20, file);
    let len = model.write_to(&mut out).map_err(|e| match e {
        WriteError::Invalid(e) => usage(e),
        WriteError::Io(e) => io_at(path, e),
    })?;
    out.flush().map_err(|e| io_at(path, e))?;
    Ok(len)
}

/// An i/o error that names the file.
fn io_at(path: &Path, e: std::io::Error) -> CliError {
    CliError::Io(std::io::Error::new(
        e.kind(),
        format!("{}: {e}", path.display()),
    ))
}
