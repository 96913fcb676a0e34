//! The binaries' output to stdout, where a failed write is an error, never a panic.
//!
//! `println!` panics when stdout cannot be written: `vpagectl status | head -1` closes
//! the pipe after one line and the next line's write fails with `EPIPE` (Rust ignores
//! `SIGPIPE`, so the write returns the error). The binaries write through [`line`] (the
//! [`outln!`](crate::outln) macro) instead, which returns the error naming stdout, and
//! end through [`exit_code`]: a closed pipe ends the command quietly with status 0,
//! the reader having taken what it wanted; any other failure (`> /dev/full`) is an
//! error message on stderr and a non-zero status. [`parse_args`] prints `--help` and
//! `--version` the same way.

use std::fmt;
use std::io::{ErrorKind, Write};
use std::process::ExitCode;

/// Writes `args` and a newline to stdout. A failure is the I/O error of its kind,
/// its message saying that writing to stdout failed.
pub fn line(args: fmt::Arguments<'_>) -> std::io::Result<()> {
    let mut out = std::io::stdout().lock();
    out.write_fmt(args)
        .and_then(|()| out.write_all(b"\n"))
        .map_err(stdout_error)
}

/// Writes `text` to stdout as it is.
pub fn text(text: &str) -> std::io::Result<()> {
    std::io::stdout()
        .lock()
        .write_all(text.as_bytes())
        .map_err(stdout_error)
}

/// Flushes stdout: whatever is still buffered must reach it before the command
/// reports success.
pub fn flush() -> std::io::Result<()> {
    std::io::stdout().lock().flush().map_err(stdout_error)
}

fn stdout_error(e: std::io::Error) -> std::io::Error {
    std::io::Error::new(e.kind(), format!("writing to stdout: {e}"))
}

/// `println!` whose failure is an `std::io::Result` instead of a panic:
/// `outln!("{x}")?` in a function returning a result that I/O errors convert into.
#[macro_export]
macro_rules! outln {
    ($($arg:tt)*) => {
        $crate::stdout::line(format_args!($($arg)*))
    };
}

/// Whether `e`, or an error it wraps, is a write to a closed pipe.
pub fn is_broken_pipe(e: &(dyn std::error::Error + 'static)) -> bool {
    std::iter::successors(Some(e), |e| e.source()).any(|e| {
        e.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == ErrorKind::BrokenPipe)
    })
}

/// How a binary `program` ends: `ok` with stdout flushed; a closed stdout pipe, at any
/// point, with status 0 and nothing said (the reader has what it wanted); any other
/// error as `program: error: ...` on stderr with status `failure`.
pub fn exit_code(program: &str, result: Result<ExitCode, anyhow::Error>, failure: u8) -> ExitCode {
    match result.and_then(|ok| flush().map(|()| ok).map_err(anyhow::Error::from)) {
        Ok(code) => code,
        Err(e) if is_broken_pipe(e.as_ref()) => ExitCode::SUCCESS,
        Err(e) => {
            // Stderr may be gone too: nothing is left to tell, but the status.
            let _ = writeln!(std::io::stderr(), "{program}: error: {e:#}");
            ExitCode::from(failure)
        }
    }
}

/// Parses the command line. `--help` and `--version` are written to stdout through
/// [`text`] (a closed pipe ends quietly, a failed write is an error) and end the
/// program: `Err` holds its exit status. A bad command line is reported on stderr with
/// clap's status (2).
pub fn parse_args<C: clap::Parser>(program: &str) -> Result<C, ExitCode> {
    let e = match C::try_parse() {
        Ok(cli) => return Ok(cli),
        Err(e) => e,
    };
    if e.use_stderr() {
        let _ = e.print();
        return Err(ExitCode::from(u8::try_from(e.exit_code()).unwrap_or(2)));
    }
    let written = text(&e.render().to_string()).map_err(anyhow::Error::from);
    Err(exit_code(program, written.map(|()| ExitCode::SUCCESS), 2))
}
