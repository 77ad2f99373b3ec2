//! Capturing what the agent logs, for tests that a condition is logged once
//! per change. One logger per process: nextest runs each test in a process
//! of its own, so a test sees only its own lines.

use std::sync::OnceLock;

use parking_lot::Mutex;

pub struct Capture(Mutex<Vec<(log::Level, String)>>);

impl log::Log for Capture {
    fn enabled(&self, _: &log::Metadata<'_>) -> bool {
        true
    }
    fn log(&self, record: &log::Record<'_>) {
        self.0
            .lock()
            .push((record.level(), record.args().to_string()));
    }
    fn flush(&self) {}
}

/// Installs the capture as this process's logger (once) and returns it.
pub fn capture() -> &'static Capture {
    static CAPTURE: OnceLock<&'static Capture> = OnceLock::new();
    CAPTURE.get_or_init(|| {
        let c: &'static Capture = Box::leak(Box::new(Capture(Mutex::new(Vec::new()))));
        if log::set_logger(c).is_ok() {
            log::set_max_level(log::LevelFilter::Debug);
        }
        c
    })
}

impl Capture {
    /// How many lines at `level` contain `text`.
    pub fn count(&self, level: log::Level, text: &str) -> usize {
        self.0
            .lock()
            .iter()
            .filter(|(l, msg)| *l == level && msg.contains(text))
            .count()
    }
}
