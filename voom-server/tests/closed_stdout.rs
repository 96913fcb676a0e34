//! `voom`'s stdout closed early or unwritable (issue 8, defect 9): `voom list | head -0`
//! and `voom ... > /dev/full` panicked. A closed pipe ends quietly with status 0; any
//! other write failure is an error message and a failing status (1; 2 for
//! `--help`, clap's); neither panics. Real
//! processes, with stdout a pipe whose reader is gone or `/dev/full`.

mod common;

use std::process::{Output, Stdio};

use common::*;

enum Stdout {
    ClosedPipe,
    Full,
}

fn run(args: &[&str], stdout: Stdout, home: &std::path::Path) -> Output {
    let out = match stdout {
        Stdout::ClosedPipe => {
            let (reader, writer) = std::io::pipe().unwrap();
            drop(reader);
            Stdio::from(writer)
        }
        Stdout::Full => Stdio::from(
            std::fs::OpenOptions::new()
                .write(true)
                .open("/dev/full")
                .unwrap(),
        ),
    };
    voom()
        .args(args)
        .env("VOOM_HOME", home)
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(Stdio::piped())
        .output()
        .unwrap()
}

#[test]
fn voom_list_panicked_on_a_closed_pipe_and_on_a_full_disk() {
    let home = tempfile::tempdir().unwrap();
    copy_dir(&fixture(), &home.path().join("models").join("tiny-chat"));
    let model = home.path().join("models").join("tiny-chat");
    let model = model.to_str().unwrap();
    let commands: Vec<Vec<&str>> = vec![
        vec!["list"],
        vec!["list", "--json"],
        vec!["profiles", "list"],
        vec!["profiles", "show", "default"],
        vec!["--help"],
        vec!["--version"],
        // Generation streams to stdout: it stops at the first failed write.
        vec![
            "generate",
            "--model",
            model,
            "--prompt",
            "Hello",
            "--max-new-tokens",
            "64",
        ],
        vec![
            "generate",
            "--model",
            model,
            "--prompt",
            "Hello",
            "--max-new-tokens",
            "8",
            "--json",
        ],
    ];
    for args in &commands {
        let o = run(args, Stdout::ClosedPipe, home.path());
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            o.status.success(),
            "{args:?} on a closed pipe: {} {err}",
            o.status
        );
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert!(
            !err.contains("error"),
            "{args:?} on a closed pipe said: {err}"
        );

        let o = run(args, Stdout::Full, home.path());
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            matches!(o.status.code(), Some(1 | 2)),
            "{args:?} > /dev/full: {} {err}",
            o.status
        );
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert!(
            err.contains("voom: error: writing to stdout"),
            "{args:?} > /dev/full said: {err}"
        );
    }
}
