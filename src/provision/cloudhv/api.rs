//! cloud-hypervisor's API, over [`crate::provision::unix_http`].
//!
//! The server answers `Connection: keep-alive` even to `Connection: close`
//! and never closes a connection itself, so a body is read by its
//! Content-Length and then this side closes. Status lines have an empty
//! reason phrase (`HTTP/1.1 204 `).

use std::io;
use std::path::Path;
use std::time::Duration;

use crate::provision::unix_http;

/// One request with no body; returns the status and the body.
pub fn call(
    socket: &Path,
    method: &str,
    path: &str,
    timeout: Duration,
) -> io::Result<(u16, Vec<u8>)> {
    unix_http::request(socket, method, path, None, timeout)
}

/// `vm.info`'s `"state"`, or `None` when the VMM does not answer with one.
pub fn vm_state(socket: &Path, timeout: Duration) -> Option<String> {
    vm_info(socket, timeout)?
        .get("state")?
        .as_str()
        .map(str::to_owned)
}

/// The VMM's `vm.info` answer (its state, and the VM's whole `config`).
pub fn vm_info(socket: &Path, timeout: Duration) -> Option<serde_json::Value> {
    let (status, body) = call(socket, "GET", "/api/v1/vm.info", timeout).ok()?;
    if status != 200 {
        return None;
    }
    serde_json::from_slice(&body).ok()
}
