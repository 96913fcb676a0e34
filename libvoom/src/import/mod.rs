//! Importing models from other formats into the Hugging Face layout vOOM runs.
//!
//! [`import_gguf`] turns a llama.cpp GGUF file into a model directory: `config.json`,
//! `model.safetensors` (every tensor dequantized to f32 exactly as ggml does, then
//! rounded to BF16 to nearest even; or, [`WeightsAs::Stored`], every tensor's bytes
//! as the GGUF stores them, quantized ones as rows of ggml blocks listed in
//! config.json's `quantization_config`: a lossy model), `tokenizer.json`,
//! `tokenizer_config.json` and `generation_config.json`. Everything is written into a staging directory beside the
//! destination and renamed into place at the end, so a failed import leaves nothing
//! half-done. The output depends only on the GGUF's contents: importing twice gives
//! byte-identical files.
//!
//! Supported: the `llama`, `qwen2`, `qwen3` and `qwen3moe` architectures with a
//! byte-level BPE (`gpt2`) vocabulary whose pre-tokenizer (`tokenizer.ggml.pre`) is
//! one `tokenizer.rs` knows. Anything else is an
//! [`ImportError::Unsupported`] naming what, rather than a silently wrong model.
//! `docs/gguf-import.md` describes the mapping.

mod decoder;
mod tokenizer;

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use voom_formats::gguf::GgufFile;
use voom_formats::{DType, FormatError};

/// How an import writes the GGUF's tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightsAs {
    /// Every tensor dequantized as ggml does and rounded to BF16.
    Bf16,
    /// Every tensor dequantized as ggml does, kept in F32 (no rounding): the exact
    /// floats a quantized file stands for, the reference its lossy import computes
    /// the same bits as.
    F32,
    /// Every tensor's bytes as stored: F32/F16/BF16 as themselves, ggml block types
    /// as U8 rows of whole blocks (lossy mode, `docs/lossy.md`).
    Stored,
}

/// Why an import failed. Every variant names the file it is about.
#[derive(Debug, thiserror::Error)]
pub enum ImportError {
    /// The GGUF (or a file written) is malformed or unreadable.
    #[error(transparent)]
    Format(#[from] FormatError),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A valid GGUF describing something the importer does not convert.
    #[error("{path}: unsupported {what}")]
    Unsupported { path: PathBuf, what: String },
    /// The GGUF's metadata and tensors disagree (missing tensor, wrong shape, ...).
    #[error("{path}: {detail}")]
    Inconsistent { path: PathBuf, detail: String },
    /// The vocabulary cannot make a tokenizer (duplicate token, bad merge, ...).
    #[error("{path}: tokenizer: {detail}")]
    Tokenizer { path: PathBuf, detail: String },
    /// The destination already holds something.
    #[error("{0}: output directory already exists and is not empty")]
    OutputExists(PathBuf),
}

impl ImportError {
    fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        ImportError::Io {
            path: path.into(),
            source,
        }
    }
}

/// What an import produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImportReport {
    /// `general.architecture` (`"llama"`).
    pub architecture: String,
    /// `general.name`, when the file has one.
    pub name: Option<String>,
    /// Tensors written to `model.safetensors`.
    pub tensors: usize,
    /// Parameters (elements) written.
    pub parameters: u64,
    /// Elements whose dequantized f32 value is not a BF16 value, so rounding to BF16
    /// changed them (0 for a GGUF made from a BF16 checkpoint without quantization).
    pub rounded_elements: u64,
    /// Bytes of all files written.
    pub bytes_written: u64,
    /// Where tensors were kept as stored and some are ggml blocks: the scheme the
    /// model's labels name (`q4_k_m`). `None`: the model computes on floats only.
    pub scheme: Option<String>,
    /// The directory written.
    pub out_dir: PathBuf,
}

/// Imports a GGUF model into a Hugging Face directory `out_dir`, which must not exist
/// or be empty. `progress(done, total)` is called as tensors are converted, in bytes of
/// GGUF tensor data.
pub fn import_gguf(
    gguf_path: &Path,
    out_dir: &Path,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<ImportReport, ImportError> {
    import_with(gguf_path, out_dir, true, WeightsAs::Bf16, progress)
}

/// [`import_gguf`] writing the weights `how`.
pub fn import_gguf_as(
    gguf_path: &Path,
    out_dir: &Path,
    how: WeightsAs,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<ImportReport, ImportError> {
    import_with(gguf_path, out_dir, true, how, progress)
}

/// [`import_gguf`] into `dir`, an existing empty directory, with no staging of its
/// own: for a caller that builds more beside the import (a page manifest) in a
/// staging directory it names, renames and cleans up itself. A failed import
/// leaves `dir` partly written.
pub fn import_gguf_unstaged(
    gguf_path: &Path,
    dir: &Path,
    how: WeightsAs,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<ImportReport, ImportError> {
    import_with(gguf_path, dir, false, how, progress)
}

fn import_with(
    gguf_path: &Path,
    out_dir: &Path,
    staged: bool,
    how: WeightsAs,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<ImportReport, ImportError> {
    let gguf = GgufFile::open(gguf_path)?;
    let path = gguf_path.to_path_buf();

    let architecture = gguf
        .get_str("general.architecture")?
        .ok_or_else(|| gguf.missing_key("general.architecture"))?
        .to_string();
    let name = gguf.get_str("general.name")?.map(str::to_string);
    let Some(arch) = decoder::Arch::of(&architecture) else {
        return Err(ImportError::Unsupported {
            path,
            what: format!(
                "architecture '{architecture}' (supported: {})",
                decoder::Arch::NAMES
            ),
        });
    };
    let params = decoder::Params::from_gguf(&gguf, arch)?;
    // The tokenizer first: it is cheap and rejects unsupported vocabularies before the
    // expensive tensor conversion.
    let tok = tokenizer::build(&gguf, params.context_length)?;
    if tok.vocab_len as u64 != params.vocab_size {
        return Err(ImportError::Inconsistent {
            path,
            detail: format!(
                "{} tokens in tokenizer.ggml.tokens but vocab_size is {}",
                tok.vocab_len, params.vocab_size
            ),
        });
    }
    // Claim the destination before the expensive conversion.
    let staging = if staged {
        Some(Staging::new(out_dir)?)
    } else {
        let mut entries = fs::read_dir(out_dir).map_err(|e| ImportError::io(out_dir, e))?;
        if entries.next().is_some() {
            return Err(ImportError::OutputExists(out_dir.to_path_buf()));
        }
        None
    };
    let dir = staging.as_ref().map_or(out_dir, |s| s.path());
    let plan = decoder::plan_tensors(&gguf, &params)?;

    let mut bytes_written = 0u64;

    // One tensor is converted at a time and written as it is due: peak memory is one
    // tensor (its f32 values and BF16 bytes), not the model.
    let st_path = dir.join("model.safetensors");
    let stored: Vec<(DType, Vec<usize>, Option<voom_formats::gguf::GgmlType>)> = match how {
        WeightsAs::Bf16 => plan
            .iter()
            .map(|t| (DType::BF16, t.shape.clone(), None))
            .collect(),
        WeightsAs::F32 => plan
            .iter()
            .map(|t| (DType::F32, t.shape.clone(), None))
            .collect(),
        WeightsAs::Stored => plan
            .iter()
            .map(|t| t.as_stored(&path))
            .collect::<Result<_, _>>()?,
    };
    let specs: Vec<(&str, DType, &[usize])> = plan
        .iter()
        .zip(&stored)
        .map(|(t, (d, shape, _))| (t.name.as_str(), *d, shape.as_slice()))
        .collect();
    let metadata = BTreeMap::from([("format".to_string(), "pt".to_string())]);
    let total: u64 = plan.iter().map(|t| t.info.n_bytes()).sum();
    let (mut done, mut parameters, mut rounded) = (0u64, 0u64, 0u64);
    progress(done, total);
    let mut failed: Option<ImportError> = None;
    let written =
        voom_formats::safetensors::write_with(&st_path, &specs, &metadata, &mut |i, w| {
            let converted = match how {
                WeightsAs::Bf16 => decoder::convert_one(&gguf, &plan[i], false),
                WeightsAs::F32 => decoder::convert_one(&gguf, &plan[i], true),
                WeightsAs::Stored => {
                    decoder::copy_one(&gguf, &plan[i]).map(|data| decoder::ConvertedTensor {
                        data,
                        parameters: plan[i].info.n_elements(),
                        rounded_elements: 0,
                    })
                }
            };
            let c = match converted {
                Ok(c) => c,
                Err(e) => {
                    failed = Some(e);
                    return Err(std::io::Error::other("tensor conversion failed"));
                }
            };
            w.write_all(&c.data)?;
            parameters += c.parameters;
            rounded += c.rounded_elements;
            done += plan[i].info.n_bytes();
            progress(done, total);
            Ok(())
        });
    if let Some(e) = failed {
        return Err(e);
    }
    written?;
    bytes_written += fs::metadata(&st_path)
        .map_err(|e| ImportError::io(&st_path, e))?
        .len();

    let mut config = params.config_json(&tok.special_ids);
    let types: BTreeMap<&str, &str> = plan
        .iter()
        .zip(&stored)
        .filter_map(|(t, (_, _, g))| g.map(|g| (t.name.as_str(), g.name())))
        .collect();
    let scheme = (!types.is_empty()).then(|| scheme_of(&gguf, &stored));
    if let Some(scheme) = &scheme {
        let source = gguf_path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned());
        config["quantization_config"] = serde_json::json!({
            "quant_method": "gguf",
            "scheme": scheme,
            "source": source,
            "tensor_types": types,
        });
    }
    if how != WeightsAs::Bf16 {
        // The floats' dtype: F32 (a GGUF's norms are F32, kept as they are).
        config["torch_dtype"] = "float32".into();
        config["dtype"] = "float32".into();
    }
    let generation = tok.special_ids.generation_config_json();
    for (file, value) in [
        ("config.json", &config),
        ("generation_config.json", &generation),
        ("tokenizer_config.json", &tok.tokenizer_config),
    ] {
        bytes_written += write_json(&dir.join(file), value)?;
    }
    let tok_path = dir.join("tokenizer.json");
    write_file(&tok_path, tok.tokenizer_json.as_bytes())?;
    bytes_written += tok.tokenizer_json.len() as u64;

    if let Some(staging) = staging {
        staging.commit()?;
    }
    Ok(ImportReport {
        architecture,
        name,
        tensors: plan.len(),
        parameters,
        rounded_elements: rounded,
        bytes_written,
        scheme,
        out_dir: out_dir.to_path_buf(),
    })
}

/// The name of a GGUF's quantization mix, as llama.cpp's tools name it
/// (`general.file_type`, `llama_ftype`: `q4_k_m`), else that of the ggml type most of
/// its quantized bytes are in, lower case.
fn scheme_of(
    g: &GgufFile,
    stored: &[(DType, Vec<usize>, Option<voom_formats::gguf::GgmlType>)],
) -> String {
    let by_ftype = g
        .get_u32("general.file_type")
        .ok()
        .flatten()
        .and_then(ftype_name);
    if let Some(name) = by_ftype {
        return name.to_string();
    }
    let mut bytes: BTreeMap<&str, u64> = BTreeMap::new();
    for (_, shape, t) in stored {
        if let Some(t) = t {
            *bytes.entry(t.name()).or_default() += shape.iter().product::<usize>() as u64;
        }
    }
    bytes
        .into_iter()
        .max_by_key(|&(_, n)| n)
        .map_or_else(|| "gguf".into(), |(t, _)| t.to_ascii_lowercase())
}

/// llama.cpp's `llama_ftype` names (`LLAMA_FTYPE_MOSTLY_Q4_K_M` is 15: `q4_k_m`).
fn ftype_name(ftype: u32) -> Option<&'static str> {
    Some(match ftype {
        0 => "f32",
        1 => "f16",
        2 => "q4_0",
        3 => "q4_1",
        7 => "q8_0",
        8 => "q5_0",
        9 => "q5_1",
        10 => "q2_k",
        11 => "q3_k_s",
        12 => "q3_k_m",
        13 => "q3_k_l",
        14 => "q4_k_s",
        15 => "q4_k_m",
        16 => "q5_k_s",
        17 => "q5_k_m",
        18 => "q6_k",
        19 => "iq2_xxs",
        20 => "iq2_xs",
        21 => "q2_k_s",
        22 => "iq3_xs",
        23 => "iq3_xxs",
        24 => "iq1_s",
        25 => "iq4_nl",
        26 => "iq3_s",
        27 => "iq3_m",
        28 => "iq2_s",
        29 => "iq2_m",
        30 => "iq4_xs",
        31 => "iq1_m",
        32 => "bf16",
        36 => "tq1_0",
        37 => "tq2_0",
        38 => "mxfp4_moe",
        _ => return None,
    })
}

/// Pretty JSON with a trailing newline, as Hugging Face writes its config files.
fn write_json(path: &Path, value: &serde_json::Value) -> Result<u64, ImportError> {
    let mut text = serde_json::to_string_pretty(value).map_err(|e| ImportError::Io {
        path: path.to_path_buf(),
        source: e.into(),
    })?;
    text.push('\n');
    write_file(path, text.as_bytes())?;
    Ok(text.len() as u64)
}

fn write_file(path: &Path, bytes: &[u8]) -> Result<(), ImportError> {
    use std::io::Write;
    let mut f = fs::File::create(path).map_err(|e| ImportError::io(path, e))?;
    f.write_all(bytes).map_err(|e| ImportError::io(path, e))?;
    f.sync_all().map_err(|e| ImportError::io(path, e))
}

/// A directory beside the destination that becomes it on [`Staging::commit`] and is
/// removed if dropped before.
struct Staging {
    tmp: PathBuf,
    dest: PathBuf,
    committed: bool,
}

impl Staging {
    fn new(dest: &Path) -> Result<Staging, ImportError> {
        match fs::read_dir(dest) {
            Ok(mut entries) => {
                if entries.next().is_some() {
                    return Err(ImportError::OutputExists(dest.to_path_buf()));
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(ImportError::io(dest, e)),
        }
        let parent = match dest.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        fs::create_dir_all(&parent).map_err(|e| ImportError::io(&parent, e))?;
        let file_name = dest
            .file_name()
            .ok_or_else(|| ImportError::io(dest, std::io::ErrorKind::InvalidInput.into()))?;
        let mut tmp_name = std::ffi::OsString::from(".");
        tmp_name.push(file_name);
        tmp_name.push(format!(".importing-{}", std::process::id()));
        let tmp = parent.join(tmp_name);
        if tmp.exists() {
            // Left by a killed import of this same process id: ours to replace.
            fs::remove_dir_all(&tmp).map_err(|e| ImportError::io(&tmp, e))?;
        }
        fs::create_dir(&tmp).map_err(|e| ImportError::io(&tmp, e))?;
        Ok(Staging {
            tmp,
            dest: dest.to_path_buf(),
            committed: false,
        })
    }

    fn path(&self) -> &Path {
        &self.tmp
    }

    fn commit(mut self) -> Result<(), ImportError> {
        let sync_dir = |p: &Path| {
            fs::File::open(p)
                .and_then(|d| d.sync_all())
                .map_err(|e| ImportError::io(p, e))
        };
        sync_dir(&self.tmp)?;
        // An empty destination directory is replaced (rename(2) allows it).
        fs::rename(&self.tmp, &self.dest).map_err(|e| match e.kind() {
            std::io::ErrorKind::DirectoryNotEmpty | std::io::ErrorKind::AlreadyExists => {
                ImportError::OutputExists(self.dest.clone())
            }
            _ => ImportError::io(&self.dest, e),
        })?;
        self.committed = true;
        if let Some(parent) = self.dest.parent().filter(|p| !p.as_os_str().is_empty()) {
            sync_dir(parent)?;
        }
        Ok(())
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        if !self.committed {
            // Best effort: the error being returned matters more than this cleanup.
            let _ = fs::remove_dir_all(&self.tmp);
        }
    }
}

#[cfg(test)]
mod tests;
