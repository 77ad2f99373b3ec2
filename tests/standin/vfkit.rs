//! A stand-in for vfkit (v0.6.x), for tests only (built with the
//! `standin` feature, never installed). It takes vfkit's flags, serves its
//! REST API on the `--restful-uri` socket and exits as vfkit does:
//!
//! - A bad flag, a missing disk, a QCOW2 disk, or a leftover socket file:
//!   `Error: …` on stderr (cobra's form) and exit 1.
//! - `--bootloader efi,variable-store=P,create` makes P; without `,create`
//!   P must exist.
//! - `--pidfile P` gets its pid; the console log gets a boot line.
//! - `GET /vm/state` → 200 `{"state":"VirtualMachineStateRunning",…}`.
//! - `POST /vm/state {"state":"Stop"}` → 202 with an empty body, then the
//!   guest powers off and vfkit exits 0. `{"state":"HardStop"}`: exits at
//!   once, before answering (the client sees EOF). `{"state":"Pause"}`
//!   and `{"state":"Resume"}` → 200, the state `VirtualMachineStatePaused`
//!   and back; a paused guest ignores the power button.
//! - The socket file is left behind on exit, as vfkit leaves it.
//!
//! Knobs, from the environment:
//! - `STANDIN_VFKIT_FAIL=msg`: `Error: msg`, exit 1 at once.
//! - `STANDIN_VFKIT_IGNORE_STOP=1`: a guest that ignores the power button.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixListener;
use std::path::Path;
use std::time::Duration;

fn fail(msg: &str) -> ! {
    eprintln!("Error: {msg}");
    std::process::exit(1);
}

/// `--flag value` pairs; repeated flags keep every value.
fn flags() -> HashMap<String, Vec<String>> {
    let mut out: HashMap<String, Vec<String>> = HashMap::new();
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let Some(name) = flag.strip_prefix("--") else {
            fail(&format!("unexpected argument {flag:?}"));
        };
        const KNOWN: [&str; 8] = [
            "cpus",
            "memory",
            "bootloader",
            "device",
            "restful-uri",
            "pidfile",
            "log-level",
            "cloud-init",
        ];
        if !KNOWN.contains(&name) {
            fail(&format!("unknown flag: --{name}"));
        }
        let Some(value) = args.next() else {
            fail(&format!("flag needs an argument: --{name}"));
        };
        out.entry(name.to_owned()).or_default().push(value);
    }
    out
}

fn one<'a>(flags: &'a HashMap<String, Vec<String>>, name: &str) -> &'a str {
    match flags.get(name).map(Vec::as_slice) {
        Some([v]) => v,
        _ => fail(&format!("--{name} must be given once")),
    }
}

/// `key=value` options after a device's kind.
fn options(spec: &str) -> (String, HashMap<String, String>) {
    let mut parts = spec.split(',');
    let kind = parts.next().unwrap_or_default().to_owned();
    let opts = parts
        .map(|p| match p.split_once('=') {
            Some((k, v)) => (k.to_owned(), v.to_owned()),
            None => (p.to_owned(), String::new()),
        })
        .collect();
    (kind, opts)
}

fn check_disk(path: &str) {
    let mut magic = [0u8; 4];
    match std::fs::File::open(path) {
        Ok(mut f) => {
            if f.read_exact(&mut magic).is_ok() && &magic == b"QFI\xfb" {
                fail(&format!(
                    "virtio-blk: {path} is a QCOW2 image; Virtualization.framework takes raw images only"
                ));
            }
        }
        Err(e) => fail(&format!("virtio-blk: {path}: {e}")),
    }
}

fn main() {
    if let Ok(msg) = std::env::var("STANDIN_VFKIT_FAIL") {
        fail(&msg);
    }
    let flags = flags();
    one(&flags, "cpus")
        .parse::<u32>()
        .unwrap_or_else(|_| fail("--cpus is not a number"));
    one(&flags, "memory")
        .parse::<u64>()
        .unwrap_or_else(|_| fail("--memory is not a number"));
    let (kind, opts) = options(one(&flags, "bootloader"));
    let store = opts.get("variable-store").filter(|_| kind == "efi");
    let Some(store) = store else {
        fail("--bootloader: only efi,variable-store=PATH is imitated");
    };
    if opts.contains_key("create") {
        std::fs::write(store, b"efi vars").unwrap_or_else(|e| fail(&format!("{store}: {e}")));
    } else if !Path::new(store).exists() {
        fail(&format!(
            "EFI variable store {store} does not exist (add ,create)"
        ));
    }
    let console = check_devices(&flags);
    let uri = one(&flags, "restful-uri");
    let Some(socket) = uri.strip_prefix("unix://") else {
        fail(&format!("--restful-uri {uri:?}: only unix:// is imitated"));
    };
    let listener = UnixListener::bind(socket).unwrap_or_else(|e| {
        fail(&format!("listen unix {socket}: bind: {e}"));
    });
    if let Some(pidfile) = flags.get("pidfile").and_then(|v| v.first()) {
        std::fs::write(pidfile, format!("{}", std::process::id()))
            .unwrap_or_else(|e| fail(&format!("{pidfile}: {e}")));
    }
    if let Some(path) = console {
        let _ = std::fs::write(path, b"[    0.000000] Linux version 6.1 (stand-in guest)\n");
    }
    eprintln!("time=\"now\" level=info msg=\"virtual machine is running\"");
    serve(&listener);
}

/// Its devices checked as vfkit would (a disk raw, a NIC nat with a MAC);
/// where its console goes, if it has one.
fn check_devices(flags: &HashMap<String, Vec<String>>) -> Option<String> {
    let mut console = None;
    for device in flags.get("device").into_iter().flatten() {
        let (kind, opts) = options(device);
        match kind.as_str() {
            "virtio-blk" => check_disk(opts.get("path").map_or("", String::as_str)),
            "virtio-net" => {
                if !opts.contains_key("nat") || !opts.contains_key("mac") {
                    fail("virtio-net: only nat,mac=… is imitated");
                }
            }
            "virtio-serial" => console = opts.get("logFilePath").cloned(),
            "virtio-rng" => {}
            other => fail(&format!("unknown device type {other:?}")),
        }
    }
    console
}

/// The RESTful API on `listener`, a request at a time, until a stop ends
/// the process.
fn serve(listener: &UnixListener) {
    let ignore_stop = std::env::var_os("STANDIN_VFKIT_IGNORE_STOP").is_some();
    let mut paused = false;
    for conn in listener.incoming() {
        let Ok(mut conn) = conn else { continue };
        let mut reader = BufReader::new(match conn.try_clone() {
            Ok(c) => c,
            Err(_) => continue,
        });
        let mut request_line = String::new();
        if reader.read_line(&mut request_line).is_err() {
            continue;
        }
        let mut len = 0usize;
        loop {
            let mut line = String::new();
            if reader.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
                break;
            }
            if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                len = v.trim().parse().unwrap_or(0);
            }
        }
        let mut body = vec![0u8; len];
        let _ = reader.read_exact(&mut body);
        let body = String::from_utf8_lossy(&body);
        if request_line.starts_with("POST") {
            eprintln!(
                "time=\"now\" level=info msg=\"received state change request: {}\"",
                body.trim()
            );
        }
        let answer = |conn: &mut std::os::unix::net::UnixStream, status: &str, body: &str| {
            let _ = write!(
                conn,
                "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            );
        };
        match request_line.split_whitespace().take(2).collect::<Vec<_>>()[..] {
            ["GET", "/vm/state"] => answer(
                &mut conn,
                "200 OK",
                &format!(
                    "{{\"state\":\"VirtualMachineState{}\",\"canStart\":false,\"canPause\":{},\"canResume\":{},\"canStop\":true,\"canHardStop\":true}}",
                    if paused { "Paused" } else { "Running" },
                    !paused,
                    paused
                ),
            ),
            ["POST", "/vm/state"] if body.contains("\"HardStop\"") => std::process::exit(0),
            ["POST", "/vm/state"] if body.contains("\"Pause\"") => {
                paused = true;
                answer(&mut conn, "200 OK", "");
            }
            ["POST", "/vm/state"] if body.contains("\"Resume\"") => {
                paused = false;
                answer(&mut conn, "200 OK", "");
            }
            ["POST", "/vm/state"] if body.contains("\"Stop\"") => {
                answer(&mut conn, "202 Accepted", "");
                if !ignore_stop && !paused {
                    drop(conn);
                    // The guest's orderly power-off.
                    std::thread::sleep(Duration::from_millis(50));
                    std::process::exit(0);
                }
            }
            ["POST", "/vm/state"] => answer(
                &mut conn,
                "400 Bad Request",
                "{\"error\":\"invalid state\"}",
            ),
            _ => answer(&mut conn, "404 Not Found", ""),
        }
    }
}
