//! Each VM's last events, kept in its directory for `status VM`: what the
//! agent logged about it at info and above (created, booted again after
//! its hypervisor died, unhealthy, suspended, an error), one line each,
//! with when, across agent restarts.
//!
//! The agent's log lines about a VM begin `VM <id>: `; the logger hands
//! each to [`note`] besides writing it, so an event is said once, in one
//! voice, and the file holds nothing the log does not. Bounded: past
//! [`MAX_BYTES`] the file keeps its newest half. Nothing is kept until the
//! daemon names its state dir ([`keep_in`]); a VM whose directory is gone
//! (destroyed) gets nothing back.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::OnceLock;

use crate::model::Id;
use crate::state::Layout;

/// The most an events file holds before its older half goes.
pub const MAX_BYTES: u64 = 32 << 10;

/// The state dir whose VMs' events are kept, once the daemon says.
static KEPT_IN: OnceLock<Layout> = OnceLock::new();
/// One writer at a time: a file cut to its newer half must not lose a
/// line another thread appended meanwhile.
static WRITING: parking_lot::Mutex<()> = parking_lot::Mutex::new(());

/// Keeps the events of the VMs of the state dir at `layout` from now on.
pub fn keep_in(layout: Layout) {
    let _ = KEPT_IN.set(layout);
}

/// A logger that writes as `inner` does, and keeps each line about a VM at
/// info and above as that VM's event.
pub struct Tee<L> {
    pub inner: L,
}

impl<L: log::Log> log::Log for Tee<L> {
    fn enabled(&self, metadata: &log::Metadata<'_>) -> bool {
        self.inner.enabled(metadata)
    }

    fn log(&self, record: &log::Record<'_>) {
        self.inner.log(record);
        if record.level() <= log::Level::Info && KEPT_IN.get().is_some() {
            note(record.level(), &record.args().to_string());
        }
    }

    fn flush(&self) {
        self.inner.flush();
    }
}

/// Keeps `message` as an event of the VM it is about, if it is about one
/// (`VM <id>: …`) whose directory exists.
pub fn note(level: log::Level, message: &str) {
    let Some(layout) = KEPT_IN.get() else {
        return;
    };
    let Some((vm_id, what)) = about(message) else {
        return;
    };
    let line = format!(
        "{} {:<5} {}\n",
        crate::human::utc_millis(std::time::SystemTime::now()),
        level,
        what.replace('\n', "; ")
    );
    let _one = WRITING.lock();
    let path = layout.events(&vm_id);
    if append(&path, line.as_bytes()).is_ok() {
        let _ = keep_newest_half(&path);
    }
}

/// The VM a log line is about, and what it says of it.
fn about(message: &str) -> Option<(Id, &str)> {
    let rest = message.strip_prefix("VM ")?;
    let (id, what) = rest.split_once(": ")?;
    Some((Id::parse(id).ok()?, what))
}

/// Appends to the file at `path`, made if its directory exists (a VM
/// destroyed has none, and gets nothing back).
fn append(path: &Path, line: &[u8]) -> std::io::Result<()> {
    std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .mode(crate::state::perms::FILE)
        .custom_flags(nix::libc::O_NOFOLLOW)
        .open(path)?
        .write_all(line)
}

/// Past [`MAX_BYTES`], the file keeps its newer half, from a line's start.
fn keep_newest_half(path: &Path) -> std::io::Result<()> {
    if std::fs::metadata(path)?.len() <= MAX_BYTES {
        return Ok(());
    }
    let text = std::fs::read(path)?;
    let from = text.len() - (MAX_BYTES / 2) as usize;
    let start = text[from..]
        .iter()
        .position(|b| *b == b'\n')
        .map_or(text.len(), |i| from + i + 1);
    crate::state::atomic::replace_unsynced(path, &text[start..])
}

/// The newest `n` events of `vm_id` in the state dir at `layout`, oldest
/// first; none when it has kept none.
pub fn last(layout: &Layout, vm_id: &Id, n: usize) -> Vec<String> {
    let text = std::fs::read_to_string(layout.events(vm_id)).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..]
        .iter()
        .map(|l| match Event::parse(vm_id.as_str(), l) {
            Some(e) => format!("{}  {:<7}  {:<16}  {}", e.at, e.kind, e.reason, e.what),
            None => crate::quote::inline(l),
        })
        .collect()
}

/// What an operator greps an event by: its reason, from the words the
/// agent's line about it begins with (the first rule that matches, in
/// order). The agent says each event once, in its log; the reason is read
/// from that line, not kept beside it, so a line no rule knows is `Other`.
const REASONS: &[(&str, &str)] = &[
    ("create failed", "CreateFailed"),
    ("create attempt took", "Created"),
    ("cloned from", "Cloned"),
    ("saved as a template", "Templated"),
    ("its template could not be saved", "TemplateFailed"),
    ("no longer a running template", "TemplateRemoved"),
    ("its guest was left paused", "Unpaused"),
    ("booted again", "Rebooted"),
    ("booted", "Booted"),
    ("hypervisor started", "Started"),
    ("vfkit started", "Started"),
    ("adopted", "Adopted"),
    ("found its hypervisor", "Adopted"),
    ("healthy again", "Healthy"),
    ("unhealthy", "Unhealthy"),
    ("its guest panicked", "GuestPanicked"),
    ("its hypervisor exited", "HypervisorExited"),
    ("hypervisor ", "HypervisorExited"),
    ("its guest sent nothing", "Idle"),
    ("quiet for its idle time", "Idle"),
    ("suspended in", "Suspended"),
    ("asleep", "Suspended"),
    ("woken", "Woken"),
    ("a frame for its guest woke it", "Woken"),
    ("resumed in", "Resumed"),
    ("tombstoned", "Tombstoned"),
    ("back in desired state", "Unquarantined"),
    ("quarantin", "Quarantined"),
    ("not quarantining", "Quarantined"),
    ("stopping", "Stopping"),
    ("the guest did not power off", "Stopping"),
    ("the guest powered off", "Stopping"),
    ("stopped", "Stopped"),
    ("destroy failed", "DestroyFailed"),
    ("destroyed", "Destroyed"),
    ("lost", "Lost"),
    ("spec rejected", "SpecRejected"),
    ("its network", "Network"),
    ("its published ports", "Network"),
    ("cannot open its tap", "Network"),
    ("plugged", "Plugged"),
    ("the hypervisor shut down", "Shutdown"),
    ("vfkit shut down", "Shutdown"),
];

/// The reason of an event that says `what`.
pub fn reason(what: &str) -> &'static str {
    REASONS
        .iter()
        .find(|(start, _)| what.starts_with(start))
        .map_or("Other", |(_, reason)| reason)
}

/// One event as `events` prints it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Event {
    /// When, as the file has it (UTC, RFC 3339 to the millisecond: it
    /// sorts as text).
    pub at: String,
    /// `Normal` (info) or `Warning` (warn, error).
    pub kind: &'static str,
    pub reason: &'static str,
    pub vm: String,
    pub what: String,
}

impl Event {
    /// One line of `vm`'s events file read back, or `None` for a line
    /// that is not one (a file cut by a crash mid-line).
    pub fn parse(vm: &str, line: &str) -> Option<Event> {
        let (at, rest) = line.split_once(' ')?;
        let rest = rest.trim_start();
        let (level, what) = rest.split_once(' ')?;
        let kind = match level {
            "INFO" => "Normal",
            "WARN" | "ERROR" => "Warning",
            _ => return None,
        };
        let what = what.trim_start();
        Some(Event {
            at: at.to_owned(),
            kind,
            reason: reason(what),
            vm: vm.to_owned(),
            what: crate::quote::inline(what),
        })
    }

    /// The event as one line: when, type, reason, VM, what it says.
    pub fn line(&self) -> String {
        format!(
            "{}  {:<7}  {:<16}  {:<12}  {}",
            self.at, self.kind, self.reason, self.vm, self.what
        )
    }
}

/// The events of `vm_id` (every VM of the state dir, without one), the
/// newest `n` of them, oldest first.
pub fn read(layout: &Layout, vm_id: Option<&Id>, n: usize) -> Vec<Event> {
    let mut all: Vec<Event> = vms_with_events(layout, vm_id)
        .iter()
        .flat_map(|vm| {
            let text = std::fs::read_to_string(layout.events(vm)).unwrap_or_default();
            text.lines()
                .filter_map(|l| Event::parse(vm.as_str(), l))
                .collect::<Vec<_>>()
        })
        .collect();
    // Stable: one VM's events of one millisecond keep their order.
    all.sort_by(|a, b| a.at.cmp(&b.at));
    let from = all.len().saturating_sub(n);
    all.split_off(from)
}

/// `vm_id`, or every VM of the state dir that has a directory.
fn vms_with_events(layout: &Layout, vm_id: Option<&Id>) -> Vec<Id> {
    if let Some(vm) = vm_id {
        return vec![vm.clone()];
    }
    let mut vms: Vec<Id> = std::fs::read_dir(layout.vms())
        .map(|entries| {
            entries
                .filter_map(|e| Id::parse(e.ok()?.file_name().to_str()?).ok())
                .collect()
        })
        .unwrap_or_default();
    vms.sort();
    vms
}

/// What `follow` has printed of one events file: where it read to, and
/// the last line it took (to find its place again in a file cut to its
/// newer half meanwhile).
#[derive(Default)]
struct Followed {
    len: u64,
    last: Option<String>,
}

/// The events added to each followed file since the last call, oldest
/// first: a file cut to its newer half is read again from after the last
/// line taken from it.
pub struct Follow {
    vm_id: Option<Id>,
    files: std::collections::HashMap<Id, Followed>,
}

impl Follow {
    /// Follows `vm_id` (every VM, without one) from the end of what
    /// [`read`] printed: its files as they are now.
    pub fn from_now(layout: &Layout, vm_id: Option<&Id>) -> Follow {
        let mut follow = Follow {
            vm_id: vm_id.cloned(),
            files: std::collections::HashMap::new(),
        };
        for vm in vms_with_events(layout, vm_id) {
            let text = std::fs::read_to_string(layout.events(&vm)).unwrap_or_default();
            let seen = Followed {
                len: text.len() as u64,
                last: text.lines().last().map(str::to_owned),
            };
            follow.files.insert(vm, seen);
        }
        follow
    }

    /// What was added since the last call.
    pub fn added(&mut self, layout: &Layout) -> Vec<Event> {
        let mut new = Vec::new();
        for vm in vms_with_events(layout, self.vm_id.as_ref()) {
            let path = layout.events(&vm);
            let seen = self.files.entry(vm.clone()).or_default();
            // Read only a file whose length moved: every VM's file is
            // looked at twice a second.
            if std::fs::metadata(&path).map_or(true, |m| m.len() == seen.len) {
                continue;
            }
            let Ok(text) = std::fs::read_to_string(&path) else {
                continue;
            };
            let len = text.len() as u64;
            let fresh: &str = if len > seen.len && text.is_char_boundary(seen.len as usize) {
                &text[seen.len as usize..]
            } else {
                // Cut to its newer half: after the last line taken.
                match &seen.last {
                    Some(last) => text
                        .match_indices(last.as_str())
                        .last()
                        .map_or(text.as_str(), |(at, l)| &text[at + l.len()..]),
                    None => text.as_str(),
                }
            };
            // Only whole lines: a line being written is taken next time.
            let whole = fresh.rfind('\n').map_or("", |end| &fresh[..=end]);
            let consumed = fresh.len() - whole.len();
            seen.len = len - consumed as u64;
            if let Some(last) = whole.lines().last() {
                seen.last = Some(last.to_owned());
            }
            new.extend(whole.lines().filter_map(|l| Event::parse(vm.as_str(), l)));
        }
        new.sort_by(|a, b| a.at.cmp(&b.at));
        new
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_about_a_vm_names_it_and_what_it_says() {
        let (vm, what) = about("VM web-1: booted again: its hypervisor died").expect("a VM's");

        assert_eq!(vm.as_str(), "web-1");
        assert_eq!(what, "booted again: its hypervisor died");
        assert!(about("host checks: 11 of 11 ok").is_none());
        assert!(about("VM ../x: no").is_none(), "an id, never a path");
    }

    #[test]
    fn an_event_is_given_its_reason_by_what_its_line_begins_with() {
        let cases = [
            (
                "create failed (1 of 3 attempts spent): no image",
                "CreateFailed",
            ),
            (
                "cloned from tpl: restored and made its own 464 ms",
                "Cloned",
            ),
            ("booted again: its hypervisor died", "Rebooted"),
            (
                "hypervisor 20348 exited (exit status 0)",
                "HypervisorExited",
            ),
            ("suspended in 309 ms", "Suspended"),
            ("woken by 10.0.0.7:51234", "Woken"),
            (
                "tombstoned from desired state; quarantined and stopping",
                "Tombstoned",
            ),
            ("back in desired state, leaving quarantine", "Unquarantined"),
            ("destroyed", "Destroyed"),
            (
                "spec rejected: vcpus: 0 is not a count of vCPUs",
                "SpecRejected",
            ),
            ("plugged: 100.77.20.16 on its tap ec4c291410", "Plugged"),
            ("the hypervisor shut down when asked", "Shutdown"),
            ("something no rule knows", "Other"),
        ];

        let got: Vec<&str> = cases.iter().map(|(what, _)| reason(what)).collect();

        assert_eq!(got, cases.iter().map(|(_, r)| *r).collect::<Vec<_>>());
    }

    #[test]
    fn an_events_line_reads_back_with_its_type() {
        let e = Event::parse(
            "web-1",
            "2026-12-06T18:32:13.156Z WARN  the guest did not power off within 1 s",
        )
        .expect("an event");

        assert_eq!(
            (e.at.as_str(), e.kind, e.reason, e.vm.as_str()),
            ("2026-12-06T18:32:13.156Z", "Warning", "Stopping", "web-1")
        );
        assert_eq!(e.what, "the guest did not power off within 1 s");
        assert!(
            Event::parse("web-1", "2026-12-06T18:32:13.1").is_none(),
            "cut mid-line"
        );
    }

    /// A state dir with `vm`'s events file holding `lines`.
    fn with_events(dir: &Path, vm: &str, lines: &[&str]) -> Layout {
        let layout = Layout::new(dir);
        let id = Id::parse(vm).expect("an id");
        std::fs::create_dir_all(layout.vm_dir(&id)).expect("vm dir");
        let text: String = lines.iter().map(|l| format!("{l}\n")).collect();
        std::fs::write(layout.events(&id), text).expect("write");
        layout
    }

    #[test]
    fn every_vms_events_are_read_in_time_order_the_newest_kept() {
        let dir = tempfile::tempdir().expect("tempdir");
        with_events(
            dir.path(),
            "a",
            &[
                "2026-01-01T00:00:01.000Z INFO  booted",
                "2026-01-01T00:00:03.000Z INFO  stopped",
            ],
        );
        let layout = with_events(
            dir.path(),
            "b",
            &["2026-01-01T00:00:02.000Z WARN  unhealthy: its probe (tcp 22) failed"],
        );

        let events = read(&layout, None, 2);

        let seen: Vec<(&str, &str)> = events.iter().map(|e| (e.vm.as_str(), e.reason)).collect();
        assert_eq!(seen, [("b", "Unhealthy"), ("a", "Stopped")]);
    }

    #[test]
    fn following_takes_what_is_added_and_finds_its_place_in_a_file_cut_to_its_newer_half() {
        let dir = tempfile::tempdir().expect("tempdir");
        let layout = with_events(
            dir.path(),
            "a",
            &[
                "2026-01-01T00:00:01.000Z INFO  booted",
                "2026-01-01T00:00:02.000Z INFO  stopped",
            ],
        );
        let mut follow = Follow::from_now(&layout, None);
        let id = Id::parse("a").expect("an id");
        append(
            &layout.events(&id),
            b"2026-01-01T00:00:03.000Z INFO  booted\n",
        )
        .expect("append");
        let first = follow.added(&layout);
        // Cut: the older lines gone, one more added.
        std::fs::write(
            layout.events(&id),
            "2026-01-01T00:00:03.000Z INFO  booted\n2026-01-01T00:00:04.000Z INFO  destroyed\n",
        )
        .expect("cut");
        let second = follow.added(&layout);

        let at = |v: &[Event]| v.iter().map(|e| e.at.clone()).collect::<Vec<_>>();
        assert_eq!(at(&first), ["2026-01-01T00:00:03.000Z"]);
        assert_eq!(at(&second), ["2026-01-01T00:00:04.000Z"]);
    }

    #[test]
    fn a_file_past_its_bound_keeps_its_newest_half_from_a_lines_start() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("events.log");
        for i in 0..2000 {
            append(&path, format!("event {i:05} of a VM\n").as_bytes()).expect("append");
            keep_newest_half(&path).expect("bound");
        }

        let text = std::fs::read_to_string(&path).expect("read");

        assert!(text.len() as u64 <= MAX_BYTES, "{}", text.len());
        assert!(text.starts_with("event "), "from a line's start");
        assert!(text.ends_with("event 01999 of a VM\n"));
    }
}
