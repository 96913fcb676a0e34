//! The harness the `voom serve` tests share: a real server process on the committed
//! chat fixture (`tests/fixtures/tiny_chat`) and a minimal HTTP/1.1 client over
//! plain `TcpStream`s, so that requests go out exactly as written.

// Each test binary uses its own part of the harness.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Value};

/// The model id the fixture is served under.
pub const MODEL: &str = "tiny-chat";
/// How long any one reply may take before a test fails rather than hangs.
pub const REPLY_TIMEOUT: Duration = Duration::from_secs(120);

pub fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tiny_chat")
}

/// The real model, provided by scripts/test (`voom pull smollm2-135m-instruct`);
/// `None`, with a printed reason, where it is absent and not required.
pub fn smollm2() -> Option<PathBuf> {
    match std::env::var_os("VOOM_SMOLLM2_DIR") {
        Some(d) if Path::new(&d).join("config.json").exists() => Some(PathBuf::from(d)),
        _ => {
            if std::env::var("VOOM_REQUIRE_SMOLLM2").as_deref() == Ok("1") {
                panic!("VOOM_REQUIRE_SMOLLM2=1 but VOOM_SMOLLM2_DIR does not hold the model");
            }
            eprintln!("skipping: set VOOM_SMOLLM2_DIR (scripts/test does)");
            None
        }
    }
}

pub fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

/// `voom` with no `VOOM_*` settings inherited from the environment, one engine thread
/// (several servers run at once on small machines).
pub fn voom() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_voom"));
    for (k, _) in std::env::vars() {
        if k.starts_with("VOOM_") && k != "VOOM_HOME" {
            c.env_remove(k);
        }
    }
    c.env("VOOM_THREADS", "1");
    c
}

/// A running `voom serve`, killed when dropped.
pub struct Server {
    pub child: Child,
    pub addr: SocketAddr,
    /// Everything the server wrote to stderr so far (shown when a test fails).
    pub log: Arc<Mutex<String>>,
    pub models: tempfile::TempDir,
}

impl Server {
    pub fn start(extra: &[&str]) -> Server {
        Self::start_with(extra, false)
    }

    /// `manifest`: give the model copy a page manifest (the store core's page cache,
    /// `--cache-budget`, needs one).
    pub fn start_with(extra: &[&str], manifest: bool) -> Server {
        let models = tempfile::tempdir().unwrap();
        copy_dir(&fixture(), &models.path().join(MODEL));
        if manifest {
            let dir = models.path().join(MODEL);
            let ckpt = voom_formats::Checkpoint::open(&dir).unwrap();
            voom_formats::Manifest::build(&ckpt, &mut |_, _| {})
                .unwrap()
                .save(&dir)
                .unwrap();
        }
        Self::start_over(models, extra)
    }

    /// A server over the models in `models` (one directory per model id).
    pub fn start_over(models: tempfile::TempDir, extra: &[&str]) -> Server {
        let mut child = voom()
            .args(["serve", "--port", "0", "--models-dir"])
            .arg(models.path())
            .args(extra)
            .env("VOOM_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawning voom serve");
        let stderr = child.stderr.take().unwrap();
        let log = Arc::new(Mutex::new(String::new()));
        let (tx, rx) = mpsc::channel();
        let log2 = Arc::clone(&log);
        // Drains stderr for the server's whole life so that it never blocks on a full
        // pipe; the first "listening on" line gives the address.
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                if let Some(rest) = line.split("listening on http://").nth(1) {
                    let addr = rest.split_whitespace().next().unwrap_or("").to_string();
                    let _ = tx.send(addr);
                }
                let mut l = log2.lock().unwrap();
                l.push_str(&line);
                l.push('\n');
            }
        });
        let addr = match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(a) => a
                .parse()
                .unwrap_or_else(|e| panic!("bad address '{a}' ({e})")),
            Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "voom serve did not print its address; stderr:\n{}",
                    log.lock().unwrap()
                );
            }
        };
        Server {
            child,
            addr,
            log,
            models,
        }
    }

    pub fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    /// Waits (a few seconds at most) for `what` to appear in the server's log.
    #[track_caller]
    pub fn wait_for_log(&self, what: &str) {
        let t = std::time::Instant::now();
        while !self.log().contains(what) {
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "'{what}' never appeared in the log:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn model_dir(&self) -> PathBuf {
        self.models.path().join(MODEL)
    }

    /// Fails the test (with the server's log) if the process has exited.
    pub fn assert_alive(&mut self) {
        if let Some(st) = self.child.try_wait().unwrap() {
            panic!("voom serve exited ({st}); stderr:\n{}", self.log());
        }
    }

    pub fn get(&self, path: &str) -> Reply {
        request(self.addr, "GET", path, None)
    }

    pub fn post(&self, path: &str, body: &[u8]) -> Reply {
        request(self.addr, "POST", path, Some(body))
    }

    pub fn post_json(&self, path: &str, body: &Value) -> Reply {
        self.post(path, body.to_string().as_bytes())
    }

    /// `/health` answers ok and a real request still completes.
    pub fn assert_healthy(&mut self) {
        self.assert_alive();
        let h = self.get("/health");
        assert_eq!(h.status, 200, "{}", h.text());
        assert_eq!(h.json()["status"], "ok");
        let r = self.post_json("/v1/chat/completions", &chat("Hello", 4));
        assert_eq!(r.status, 200, "{}\nserver log:\n{}", r.text(), self.log());
        assert!(r.json()["usage"]["completion_tokens"].as_u64().unwrap() >= 1);
    }

    pub fn metric(&self, name: &str) -> f64 {
        let m = self.get("/metrics");
        assert_eq!(m.status, 200);
        let text = m.text();
        text.lines()
            .find_map(|l| {
                let (n, v) = l.rsplit_once(' ')?;
                (n == name).then(|| v.parse::<f64>().unwrap())
            })
            .unwrap_or_else(|| panic!("no metric {name} in:\n{text}"))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// An HTTP reply, its body already de-chunked.
pub struct Reply {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Reply {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "status {}: body is not JSON ({e}): {}",
                self.status,
                self.text()
            )
        })
    }

    /// The `data:` payloads of a server-sent-events body.
    pub fn sse_data(&self) -> Vec<String> {
        sse_data(&self.text())
    }
}

pub fn sse_data(text: &str) -> Vec<String> {
    text.lines()
        .filter_map(|l| l.strip_prefix("data:"))
        .map(|d| d.trim_start().to_string())
        .collect()
}

pub fn connect(addr: SocketAddr) -> TcpStream {
    let s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(REPLY_TIMEOUT)).unwrap();
    s.set_write_timeout(Some(REPLY_TIMEOUT)).unwrap();
    s
}

pub fn head(method: &str, path: &str, addr: SocketAddr, len: Option<usize>) -> String {
    let mut h = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    if let Some(n) = len {
        h += &format!("Content-Type: application/json\r\nContent-Length: {n}\r\n");
    }
    h + "\r\n"
}

/// One request on a fresh connection (`Connection: close`), read to its end.
pub fn request(addr: SocketAddr, method: &str, path: &str, body: Option<&[u8]>) -> Reply {
    let mut s = connect(addr);
    let mut msg = head(method, path, addr, body.map(<[u8]>::len)).into_bytes();
    msg.extend_from_slice(body.unwrap_or_default());
    // The server may answer (413) and close before reading all of a large body: a
    // failed write is then expected, and the reply is still read.
    let _ = s.write_all(&msg);
    read_reply(&mut s)
}

/// Reads a whole reply up to the end of the connection. Data received before a reset
/// is kept: a server that answers early and closes may reset the connection.
pub fn read_reply(s: &mut TcpStream) -> Reply {
    read_reply_after(s, Vec::new())
}

/// Like [`read_reply`], for a reply whose first bytes (`raw`) were read already.
pub fn read_reply_after(s: &mut TcpStream, mut raw: Vec<u8>) -> Reply {
    let mut buf = [0u8; 16384];
    loop {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => raw.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) if !raw.is_empty() && e.kind() == ErrorKind::ConnectionReset => break,
            Err(e) => panic!("reading the reply: {e} (got so far: {})", shown(&raw)),
        }
    }
    parse_reply(&raw).unwrap_or_else(|| panic!("not an HTTP reply: {}", shown(&raw)))
}

/// Raw bytes for a failure message, cut to a readable length.
pub fn shown(raw: &[u8]) -> String {
    let s = String::from_utf8_lossy(raw);
    match s.char_indices().nth(2000) {
        Some((i, _)) => format!("{:?}... ({} bytes)", &s[..i], raw.len()),
        None => format!("{s:?}"),
    }
}

pub fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

pub fn parse_reply(raw: &[u8]) -> Option<Reply> {
    let end = find(raw, b"\r\n\r\n")?;
    let head = std::str::from_utf8(&raw[..end]).ok()?;
    let mut lines = head.split("\r\n");
    let status_line = lines.next()?;
    let status: u16 = status_line.split(' ').nth(1)?.parse().ok()?;
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect();
    let mut body = raw[end + 4..].to_vec();
    let chunked = headers.iter().any(|(k, v)| {
        k.eq_ignore_ascii_case("transfer-encoding") && v.eq_ignore_ascii_case("chunked")
    });
    if chunked {
        body = dechunk(&body)?;
    }
    Some(Reply {
        status,
        headers,
        body,
    })
}

pub fn dechunk(mut b: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let eol = find(b, b"\r\n")?;
        let size_field = std::str::from_utf8(&b[..eol]).ok()?;
        let size = usize::from_str_radix(size_field.split(';').next()?.trim(), 16).ok()?;
        b = &b[eol + 2..];
        if size == 0 {
            return Some(out);
        }
        out.extend_from_slice(b.get(..size)?);
        b = b.get(size + 2..)?;
    }
}

/// A chat request body: one user message, greedy.
pub fn chat(text: &str, max_tokens: u64) -> Value {
    json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0,
    })
}

/// Asserts a 4xx OpenAI error body (JSON, with a message and a type) naming `param`.
#[track_caller]
pub fn assert_openai_error(r: &Reply, status: u16, param: &str, what: &str) {
    assert_eq!(r.status, status, "{what}: {}", r.text());
    assert!(
        r.header("content-type")
            .is_some_and(|c| c.starts_with("application/json")),
        "{what}: content-type {:?}",
        r.header("content-type")
    );
    let j = r.json();
    let e = &j["error"];
    assert!(e["message"].is_string(), "{what}: {j}");
    assert!(e["type"].is_string(), "{what}: {j}");
    assert_eq!(e["param"], param, "{what}: {j}");
}

/// Asserts a 4xx Anthropic error body (`type` and `error`, nothing else) of type `ty`
/// whose message names `field`.
#[track_caller]
pub fn assert_anthropic_error(r: &Reply, status: u16, ty: &str, field: &str, what: &str) {
    assert_eq!(r.status, status, "{what}: {}", r.text());
    let j = r.json();
    assert_eq!(j["type"], "error", "{what}: {j}");
    assert_eq!(j["error"]["type"], ty, "{what}: {j}");
    let m = j["error"]["message"].as_str().unwrap_or_default();
    assert!(
        m.contains(field),
        "{what}: the message does not name '{field}': {j}"
    );
    assert_eq!(j.as_object().unwrap().len(), 2, "{what}: {j}");
}
