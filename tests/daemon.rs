//! The tick loop against a fake control plane on 127.0.0.1 and the fake
//! provisioner: round trips, outages, bad answers, backoff.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use common::{SETTLE, config};
use eitri_agent::config::ControlPlane;
use eitri_agent::daemon::{Clock, Contact, Daemon, Parts};
use eitri_agent::deadline::Deadline;
use eitri_agent::pb;
use eitri_agent::reconcile::Engine;
use eitri_agent::source::HttpSource;
use eitri_agent::state::Store;
use eitri_agent::testkit::control_plane::{Answer, FakeControlPlane};
use eitri_agent::testkit::{Call, Fakes, id, image_url};

const TICK: Duration = Duration::from_secs(1);
const BACKOFF_MAX: Duration = Duration::from_secs(16);

/// A clock the test moves by hand.
#[derive(Clone, Default)]
struct FakeClock(Arc<AtomicU64>);

impl FakeClock {
    fn advance(&self, by: Duration) {
        self.0.fetch_add(by.as_millis() as u64, Ordering::Relaxed);
    }
}

impl Clock for FakeClock {
    fn now(&self) -> Duration {
        Duration::from_millis(self.0.load(Ordering::Relaxed))
    }
}

struct Agent {
    dir: tempfile::TempDir,
    fakes: Arc<Fakes>,
    clock: FakeClock,
    daemon: Daemon,
}

fn cp_config(url: &str, token_file: Option<std::path::PathBuf>) -> ControlPlane {
    ControlPlane {
        base_url: url.to_owned(),
        token_file,
        connect_timeout: Duration::from_millis(500),
        request_timeout: Duration::from_millis(500),
        max_response_bytes: 64 * 1024,
    }
}

fn agent_in(dir: tempfile::TempDir, fakes: Arc<Fakes>, url: &str) -> Agent {
    let store = Arc::new(Store::open(dir.path()).expect("store"));
    let engine = Engine::new(Arc::clone(&store), fakes.seams(), config());
    let clock = FakeClock::default();
    let token = dir.path().join("token");
    let daemon = Daemon::new(
        TICK,
        BACKOFF_MAX,
        Parts {
            store,
            engine,
            source: Box::new(HttpSource::new(cp_config(url, Some(token)))),
            host: pb::HostInfo {
                host_id: "host-a".into(),
                ..Default::default()
            },
            clock: Box::new(clock.clone()),
            // Always the top of the window, so the ceiling is observable.
            jitter: Box::new(|| 1.0),
            readiness: None,
            notes: vec![],
        },
    );
    Agent {
        dir,
        fakes,
        clock,
        daemon,
    }
}

fn agent(url: &str) -> Agent {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("token"), "s3cret\n").expect("token");
    agent_in(dir, Fakes::new(), url)
}

impl Agent {
    fn tick(&mut self) -> Contact {
        let t = self.daemon.tick();
        assert!(self.daemon.engine().wait_idle(Deadline::after(SETTLE)));
        t.contact
    }

    /// Ticks once the next contact is due.
    fn tick_when_due(&mut self) -> Contact {
        let t = self.daemon.tick();
        match t.contact {
            Contact::Waiting { due_in } => {
                self.clock.advance(due_in);
                self.tick()
            }
            other => other,
        }
    }
}

fn snapshot_with(vm: &str, epoch: u64) -> pb::Snapshot {
    pb::Snapshot {
        epoch,
        vms: vec![pb::VmSpec {
            vm_id: vm.into(),
            name: vm.into(),
            image_url: image_url(vm),
            image_sha256: "ab".repeat(32),
            vcpus: 1,
            mem_mb: 256,
            disk_gb: 1,
            power_state: "running".into(),
            ..Default::default()
        }],
        ..Default::default()
    }
}

fn row<'a>(report: &'a pb::ReportRequest, vm: &str) -> Option<&'a pb::VmStatus> {
    report.report.as_ref()?.vms.iter().find(|r| r.vm_id == vm)
}

#[test]
fn snapshot_step_report_round_trip() {
    let cp = FakeControlPlane::start().expect("cp");
    cp.answer_snapshots(Answer::Snapshot(snapshot_with("vm-1", 3)));
    let mut a = agent(&cp.url());

    a.tick();
    a.tick();

    let reports = cp.reports();
    let last = reports.last().expect("a report");
    let vm = row(last, "vm-1").expect("vm-1 row");
    assert_eq!(
        (vm.power_state.as_str(), vm.phase.as_str()),
        ("running", "ready")
    );
    assert_eq!(last.report.as_ref().map(|r| r.last_seen_epoch), Some(3));
    assert_eq!(
        last.host.as_ref().map(|h| h.host_id.as_str()),
        Some("host-a")
    );
}

#[test]
fn requests_carry_the_bearer_token_and_protobuf_type() {
    let cp = FakeControlPlane::start().expect("cp");
    let mut a = agent(&cp.url());

    a.tick();

    let requests = cp.requests();
    assert_eq!(requests.len(), 2, "snapshot then report");
    assert!(
        requests
            .iter()
            .all(|r| r.header("authorization") == Some("Bearer s3cret"))
    );
    assert!(
        requests
            .iter()
            .all(|r| r.header("content-type") == Some("application/x-protobuf"))
    );
}

#[test]
fn control_plane_down_at_start_then_up() {
    let port = FakeControlPlane::free_port().expect("port");
    let mut a = agent(&format!("http://127.0.0.1:{port}"));

    let down = a.tick();
    let cp = FakeControlPlane::start_on(port).expect("cp comes up");
    cp.answer_snapshots(Answer::Snapshot(snapshot_with("vm-1", 1)));
    let up = a.tick_when_due();

    assert!(matches!(down, Contact::Failed { .. }), "{down:?}");
    assert!(
        a.dir.path().join("report.json").exists(),
        "reported while down"
    );
    assert_eq!(up, Contact::Ok);
    assert_eq!(a.fakes.count(|c| *c == Call::Boot(id("vm-1"))), 1);
}

/// Converges vm-1 from a good control plane, then makes every answer bad,
/// crashes the VM, and ticks: the agent must restart it from its last
/// snapshot. Returns the failed contact and the number of boots.
fn crash_while_answers_are(bad: Answer) -> (Contact, usize) {
    let cp = FakeControlPlane::start().expect("cp");
    cp.answer_snapshots(Answer::Snapshot(snapshot_with("vm-1", 1)));
    let mut a = agent(&cp.url());
    a.tick();
    cp.answer_snapshots(bad);
    a.fakes.set_running(&id("vm-1"), false);

    let contact = a.tick_when_due();
    a.tick();

    (contact, a.fakes.count(|c| *c == Call::Boot(id("vm-1"))))
}

#[test]
fn server_errors_leave_the_agent_on_its_last_snapshot() {
    let (contact, boots) = crash_while_answers_are(Answer::Status(500));

    assert!(
        matches!(&contact, Contact::Failed { error, .. } if error.contains("500")),
        "{contact:?}"
    );
    assert_eq!(boots, 2, "restarted from the last snapshot");
}

#[test]
fn garbage_leaves_the_agent_on_its_last_snapshot() {
    let (contact, boots) = crash_while_answers_are(Answer::Garbage);

    assert!(
        matches!(&contact, Contact::Failed { error, .. } if error.contains("not a valid message")),
        "{contact:?}"
    );
    assert_eq!(boots, 2);
}

#[test]
fn oversized_answers_leave_the_agent_on_its_last_snapshot() {
    let (contact, boots) = crash_while_answers_are(Answer::Oversized(1 << 20));

    assert!(
        matches!(&contact, Contact::Failed { error, .. } if error.contains("larger than")),
        "{contact:?}"
    );
    assert_eq!(boots, 2);
}

#[test]
fn a_server_slower_than_the_timeout_leaves_the_agent_on_its_last_snapshot() {
    let slow = Answer::Slow(
        Duration::from_secs(2),
        Box::new(Answer::Snapshot(pb::Snapshot::default())),
    );

    let (contact, boots) = crash_while_answers_are(slow);

    assert!(matches!(contact, Contact::Failed { .. }), "{contact:?}");
    assert_eq!(boots, 2);
}

#[test]
fn rejected_token_is_said_plainly() {
    let cp = FakeControlPlane::start().expect("cp");
    cp.answer_snapshots(Answer::Status(401));
    let mut a = agent(&cp.url());

    let contact = a.tick();

    assert!(
        matches!(&contact, Contact::Failed { error, .. } if error.contains("token rejected")),
        "{contact:?}"
    );
}

#[test]
fn restart_during_an_outage_keeps_converging() {
    let cp = FakeControlPlane::start().expect("cp");
    cp.answer_snapshots(Answer::Snapshot(snapshot_with("vm-1", 1)));
    let mut a = agent(&cp.url());
    a.tick();
    let port = cp.port();
    drop(cp);
    let Agent {
        dir, fakes, daemon, ..
    } = a;
    drop(daemon);
    fakes.set_running(&id("vm-1"), false);

    let mut restarted = agent_in(dir, fakes, &format!("http://127.0.0.1:{port}"));
    let contact = restarted.tick();

    assert!(matches!(contact, Contact::Failed { .. }));
    assert_eq!(restarted.fakes.count(|c| *c == Call::Boot(id("vm-1"))), 2);
}

#[test]
fn the_newest_report_is_sent_when_the_control_plane_returns() {
    let cp = FakeControlPlane::start().expect("cp");
    cp.answer_snapshots(Answer::Snapshot(snapshot_with("vm-1", 1)));
    let mut a = agent(&cp.url());
    a.tick();
    cp.answer_snapshots(Answer::Status(503));
    cp.answer_reports(Answer::Status(503));
    a.fakes.set_addresses(&id("vm-1"), "10.77.0.9", "");
    a.tick_when_due();
    a.tick_when_due();
    cp.answer_snapshots(Answer::Snapshot(snapshot_with("vm-1", 1)));
    cp.answer_reports(Answer::Accepted);

    a.tick_when_due();

    let last = cp.reports().pop().expect("reports");
    assert_eq!(row(&last, "vm-1").map(|r| r.ip.as_str()), Some("10.77.0.9"));
}

#[test]
fn backoff_grows_to_its_cap_and_resets_on_success() {
    let port = FakeControlPlane::free_port().expect("port");
    let mut a = agent(&format!("http://127.0.0.1:{port}"));

    let retries: Vec<Duration> = (0..7)
        .map(|_| match a.tick_when_due() {
            Contact::Failed { retry_in, .. } => retry_in,
            other => panic!("expected a failure, got {other:?}"),
        })
        .collect();
    let cp = FakeControlPlane::start_on(port).expect("cp");
    let recovered = a.tick_when_due();
    drop(cp);
    let after = a.tick_when_due();

    let s = Duration::from_secs;
    assert_eq!(retries, vec![s(1), s(2), s(4), s(8), s(16), s(16), s(16)]);
    assert_eq!(recovered, Contact::Ok);
    assert!(
        matches!(after, Contact::Failed { retry_in, .. } if retry_in == s(1)),
        "{after:?}"
    );
}

#[test]
fn no_contact_is_made_while_backing_off() {
    let cp = FakeControlPlane::start().expect("cp");
    cp.answer_snapshots(Answer::Status(500));
    let mut a = agent(&cp.url());
    a.tick_when_due();
    a.tick_when_due();
    let before = cp.requests().len();

    let waiting = a.tick();

    assert!(matches!(waiting, Contact::Waiting { .. }), "{waiting:?}");
    assert_eq!(cp.requests().len(), before);
}

#[test]
fn a_stale_snapshot_is_fenced_and_not_kept() {
    let cp = FakeControlPlane::start().expect("cp");
    cp.answer_snapshots(Answer::Snapshot(snapshot_with("vm-1", 5)));
    let mut a = agent(&cp.url());
    a.tick();
    cp.answer_snapshots(Answer::Snapshot(pb::Snapshot {
        epoch: 2,
        ..Default::default()
    }));

    a.tick();
    cp.answer_snapshots(Answer::Status(500));
    a.tick_when_due();

    let reports = cp.reports();
    let fenced = reports
        .last()
        .and_then(|r| r.report.as_ref())
        .expect("fenced report");
    assert!(fenced.fence_violation);
    assert_eq!(
        a.fakes.count(|c| matches!(c, Call::Shutdown(_))),
        0,
        "vm-1 was not reaped"
    );
}
