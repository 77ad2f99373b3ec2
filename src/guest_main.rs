//! `eitri-guest`: the guest agent. It runs in a Linux guest as root, listens
//! on vsock port 1031, and answers the host agent's requests one at a time
//! (`proto/eitri/guest/v1/guest.proto`; what each does is
//! `eitri_agent::guest::inside`). It never connects anywhere and asks the
//! host for nothing.

use std::process::ExitCode;

#[cfg(target_os = "linux")]
mod vsock {
    use std::io::{self, Read, Write};
    use std::os::fd::{AsFd, AsRawFd, OwnedFd};
    use std::time::Duration;

    use eitri_agent::deadline::Deadline;
    use eitri_agent::guest::frame::Channel;
    use eitri_agent::guest::inside::Guest;
    use eitri_agent::guest::serve::serve_one;
    use nix::sys::socket::{
        AddressFamily, Backlog, SockFlag, SockType, VsockAddr, accept, bind, listen, setsockopt,
        socket, sockopt,
    };

    /// The most one exchange may take, from the request's first byte to
    /// the answer's last: a host that stalls holds this agent no longer.
    const EXCHANGE: Duration = Duration::from_secs(10);

    /// One accepted connection.
    struct Stream(OwnedFd);

    impl Read for Stream {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            nix::unistd::read(self.0.as_fd(), buf).map_err(io::Error::from)
        }
    }

    impl Write for Stream {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            nix::unistd::write(&self.0, buf).map_err(io::Error::from)
        }

        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    impl Channel for Stream {
        fn time_left(&mut self, left: Duration) -> io::Result<()> {
            let tv = nix::sys::time::TimeVal::new(
                i64::try_from(left.as_secs()).unwrap_or(i64::MAX),
                left.subsec_micros().into(),
            );
            setsockopt(&self.0, sockopt::ReceiveTimeout, &tv)?;
            setsockopt(&self.0, sockopt::SendTimeout, &tv)?;
            Ok(())
        }
    }

    pub fn serve(port: u32) -> Result<(), String> {
        let listener = socket(
            AddressFamily::Vsock,
            SockType::Stream,
            SockFlag::SOCK_CLOEXEC,
            None,
        )
        .map_err(|e| {
            format!("cannot open a vsock socket ({e}): is virtio-vsock in this guest's kernel?")
        })?;
        let addr = VsockAddr::new(nix::libc::VMADDR_CID_ANY, port);
        bind(listener.as_raw_fd(), &addr)
            .map_err(|e| format!("cannot listen on vsock port {port}: {e}"))?;
        listen(&listener, Backlog::new(8).map_err(|e| e.to_string())?)
            .map_err(|e| format!("cannot listen on vsock port {port}: {e}"))?;
        eprintln!(
            "eitri-guest {}: listening on vsock port {port}",
            env!("CARGO_PKG_VERSION")
        );
        let guest = Guest::default();
        loop {
            let fd = match accept(listener.as_raw_fd()) {
                Ok(fd) => fd,
                Err(e) => {
                    eprintln!("eitri-guest: accept: {e}");
                    std::thread::sleep(Duration::from_millis(100));
                    continue;
                }
            };
            // SAFETY: accept returned a new fd that nothing else owns.
            let owned = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
            let mut stream = Stream(owned);
            if let Err(e) = serve_one(&mut stream, &guest, Deadline::after(EXCHANGE)) {
                eprintln!("eitri-guest: an exchange failed: {e}");
            }
        }
    }
}

fn main() -> ExitCode {
    let mut port = eitri_agent::guest::PORT;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--version" => {
                println!("eitri-guest {}", env!("CARGO_PKG_VERSION"));
                return ExitCode::SUCCESS;
            }
            "--port" => match args.next().and_then(|p| p.parse().ok()) {
                Some(p) => port = p,
                None => {
                    eprintln!("eitri-guest: --port takes a vsock port number");
                    return ExitCode::from(2);
                }
            },
            _ => {
                eprintln!(
                    "usage: eitri-guest [--port N] [--version]\n(the guest agent: run by the guest's init as root)"
                );
                return ExitCode::from(2);
            }
        }
    }
    serve(port)
}

#[cfg(target_os = "linux")]
fn serve(port: u32) -> ExitCode {
    match vsock::serve(port) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("eitri-guest: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(not(target_os = "linux"))]
fn serve(_port: u32) -> ExitCode {
    eprintln!("eitri-guest runs in a Linux guest");
    ExitCode::FAILURE
}
