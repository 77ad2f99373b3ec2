//! Signed desired state through the real binary: an agent with pinned keys
//! against a fake control plane (and, standalone, a signed desired file)
//! acts on what a pinned key signed for this host, and on nothing else.
//! "Nothing touched" is seen on disk: the volume a refused snapshot names is
//! never created.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use eitri_agent::pb;
use eitri_agent::source::FileSource;
use eitri_agent::testkit::control_plane::{Answer, FakeControlPlane};
use eitri_agent::trust::SecretKey;
use prost::Message;

use crate::{BIN, wait_for};

const HOST: &str = "signed-test-host";

/// An agent process with a state dir under `dir`; killed on drop.
struct Agent {
    child: Child,
    state: PathBuf,
}

impl Agent {
    /// `source`: `--control-plane URL` or `--desired FILE`, and any more
    /// flags.
    fn start(dir: &Path, source: &[&str]) -> Agent {
        let state = dir.join("state");
        let child = Command::new(BIN)
            .arg("run")
            .arg("--state-dir")
            .arg(&state)
            .arg("--run-dir")
            .arg(dir.join("run"))
            .args(["--host-id", HOST, "--tick", "100ms"])
            .args(if source.contains(&"--backoff-max") {
                &[][..]
            } else {
                &["--backoff-max", "200ms"][..]
            })
            .args(["--tap-prefix", "etsig", "--underlay-bridge="])
            .arg("--userfaultfd-device=")
            .args(["--hypervisor", "/nonexistent/cloud-hypervisor"])
            .arg("--agents-dir")
            .arg(dir.join("agents"))
            .args(source)
            .env_clear()
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("agent.log")).expect("log"))
            .spawn()
            .expect("spawn agent");
        Agent { child, state }
    }

    fn report(&self) -> serde_json::Value {
        std::fs::read(self.state.join("report.json"))
            .ok()
            .and_then(|t| serde_json::from_slice(&t).ok())
            .unwrap_or(serde_json::Value::Null)
    }

    fn wait_report(&self, what: &str, pred: impl Fn(&serde_json::Value) -> bool) {
        wait_for(what, || pred(&self.report()));
    }

    /// Waits until the last contact failed with a text holding `needle`.
    fn wait_refusal(&self, needle: &str) -> String {
        let mut contact = String::new();
        wait_for(&format!("a refusal naming {needle:?}"), || {
            contact = self.report()["contact"].as_str().unwrap_or("").to_owned();
            contact.contains(needle)
        });
        contact
    }

    fn volume_exists(&self, id: &str) -> bool {
        self.state
            .join("volumes")
            .join(format!("{id}.img"))
            .exists()
            || self.state.join("volumes").join(id).exists()
    }

    fn status(&self) -> String {
        let out = Command::new(BIN)
            .arg("status")
            .arg("--state-dir")
            .arg(&self.state)
            .env_clear()
            .output()
            .expect("status");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn has_volume(report: &serde_json::Value, id: &str) -> bool {
    report["report"]["volumes"]
        .as_array()
        .is_some_and(|v| v.iter().any(|v| v["volume_id"] == id))
}

fn snapshot(epoch: u64, host: &str, volume: &str) -> pb::Snapshot {
    pb::Snapshot {
        epoch,
        host_id: host.into(),
        volumes: vec![pb::VolumeSpec {
            volume_id: volume.into(),
            size_gb: 1,
            tombstoned: false,
        }],
        ..pb::Snapshot::default()
    }
}

/// A snapshot of `epoch` that resets the fence from `from`, expiring in
/// an hour (a reset must expire).
fn reset(epoch: u64, from: u64, volume: &str) -> pb::Snapshot {
    pb::Snapshot {
        epoch_reset: true,
        epoch_reset_from: from,
        not_after_unix_ms: eitri_agent::human::unix_ms(
            std::time::SystemTime::now() + Duration::from_secs(3600),
        ),
        ..snapshot(epoch, HOST, volume)
    }
}

fn signed(key: &SecretKey, snap: &pb::Snapshot) -> Vec<u8> {
    let bytes = snap.encode_to_vec();
    pb::SignedSnapshot {
        signature: key.sign(&bytes),
        key_id: key.id().into(),
        snapshot: bytes,
    }
    .encode_to_vec()
}

fn key(id: &str, n: u8) -> SecretKey {
    SecretKey::from_seed(id, [n; 32])
}

/// A trusted-keys file pinning `keys`, 0644 as an operator would leave it.
fn pin(dir: &Path, keys: &[&SecretKey]) -> PathBuf {
    let path = dir.join("trusted-keys");
    let text: String = keys.iter().map(|k| k.public_line()).collect();
    std::fs::write(&path, text).expect("trusted keys");
    path
}

/// An agent against `cp` pinning `keys`.
fn agent(dir: &Path, cp: &FakeControlPlane, keys: &Path) -> Agent {
    Agent::start(
        dir,
        &[
            "--control-plane",
            &cp.url(),
            "--trusted-keys",
            keys.to_str().expect("utf-8 path"),
        ],
    )
}

#[test]
fn a_snapshot_signed_by_a_pinned_key_is_acted_on() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cp = FakeControlPlane::start().expect("cp");
    let k = key("cp-2026", 1);
    cp.answer_snapshots(Answer::Raw(signed(&k, &snapshot(1, HOST, "data-1"))));

    let a = agent(dir.path(), &cp, &pin(dir.path(), &[&k]));

    a.wait_report("the volume", |r| has_volume(r, "data-1"));
    assert!(a.volume_exists("data-1"));
    let asked = cp.requests();
    assert!(
        asked.iter().any(|r| r
            .header("accept")
            .is_some_and(|v| v.contains("signed=ed25519"))),
        "the agent asks for a signed snapshot"
    );
}

/// The report requests `cp` received once the agent had acted on the
/// volume, with their signature headers.
fn signed_reports(cp: &FakeControlPlane, a: &Agent) -> Vec<(Option<String>, Vec<u8>)> {
    a.wait_report("the volume", |r| has_volume(r, "data-1"));
    wait_for("a report naming the volume", || {
        cp.reports().iter().any(|r| {
            r.report
                .as_ref()
                .is_some_and(|r| r.volumes.iter().any(|v| v.volume_id == "data-1"))
        })
    });
    cp.requests()
        .into_iter()
        .filter(|r| r.path == "/v1/agent/report")
        .map(|r| (r.header("eitri-signature").map(str::to_owned), r.body))
        .collect()
}

/// What `eitri-agent host-key` prints for the agent's state dir, pinned as
/// a control plane would.
fn host_key_of(a: &Agent) -> eitri_agent::trust::TrustedKeys {
    let out = eitri(&["host-key", "--state-dir", a.state.to_str().expect("path")]);
    assert!(out.status.success(), "{out:?}");
    eitri_agent::trust::TrustedKeys::parse(&String::from_utf8_lossy(&out.stdout))
        .expect("a public key line")
}

#[test]
fn each_report_is_signed_by_the_key_host_key_prints() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cp = FakeControlPlane::start().expect("cp");
    let k = key("cp", 1);
    cp.answer_snapshots(Answer::Raw(signed(&k, &snapshot(1, HOST, "data-1"))));
    let a = agent(dir.path(), &cp, &pin(dir.path(), &[&k]));

    let reports = signed_reports(&cp, &a);
    let pinned = host_key_of(&a);

    assert!(!reports.is_empty());
    for (header, body) in &reports {
        let header = header.as_deref().expect("a signature header");
        assert!(pinned.verify_report(header, body).is_ok(), "{header}");
    }
}

#[test]
fn a_report_changed_on_the_way_does_not_verify() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cp = FakeControlPlane::start().expect("cp");
    let k = key("cp", 1);
    cp.answer_snapshots(Answer::Raw(signed(&k, &snapshot(1, HOST, "data-1"))));
    let a = agent(dir.path(), &cp, &pin(dir.path(), &[&k]));
    let (header, mut body) = signed_reports(&cp, &a).pop().expect("a report");
    let pinned = host_key_of(&a);

    // What a man in the middle would change: the host's word on a volume.
    let at = body.len() - 1;
    body[at] ^= 1;
    let verified = pinned.verify_report(&header.expect("a signature header"), &body);

    assert!(
        matches!(
            verified,
            Err(eitri_agent::trust::Refusal::BadSignature { .. })
        ),
        "{verified:?}"
    );
}

#[test]
fn a_report_names_the_signed_snapshot_it_answers_and_when_it_was_sent() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cp = FakeControlPlane::start().expect("cp");
    let k = key("cp", 1);
    let snap = snapshot(7, HOST, "data-1");
    cp.answer_snapshots(Answer::Raw(signed(&k, &snap)));
    let a = agent(dir.path(), &cp, &pin(dir.path(), &[&k]));
    let before = std::time::SystemTime::now();

    let (_, body) = signed_reports(&cp, &a).pop().expect("a report");
    let request = pb::ReportRequest::decode(body.as_slice()).expect("a report request");

    let report = request.report.expect("its report");
    let want: Vec<u8> = {
        use sha2::Digest;
        sha2::Sha256::digest(snap.encode_to_vec()).to_vec()
    };
    assert_eq!(report.answers_sha256, want);
    assert_eq!(report.last_seen_epoch, 7);
    let sent = std::time::UNIX_EPOCH + Duration::from_millis(request.sent_at_unix_ms);
    let skew = Duration::from_secs(60);
    assert!(sent + skew > before && sent < std::time::SystemTime::now() + skew);
}

#[test]
fn without_keys_reports_go_unsigned_and_no_host_key_is_made() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cp = FakeControlPlane::start().expect("cp");
    cp.answer_snapshots(Answer::Snapshot(snapshot(1, HOST, "data-1")));
    let a = Agent::start(dir.path(), &["--control-plane", &cp.url()]);

    let reports = signed_reports(&cp, &a);

    assert!(reports.iter().all(|(header, _)| header.is_none()));
    assert!(!a.state.join("host-signing-key").exists());
}

#[test]
fn an_unsigned_snapshot_is_refused_and_nothing_is_touched() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cp = FakeControlPlane::start().expect("cp");
    cp.answer_snapshots(Answer::Snapshot(snapshot(1, HOST, "data-1")));

    let a = agent(dir.path(), &cp, &pin(dir.path(), &[&key("cp", 1)]));

    let contact = a.wait_refusal("not signed");
    assert!(contact.contains("nothing in it was acted on"), "{contact}");
    assert!(!a.volume_exists("data-1"));
    assert!(a.status().contains("not signed"), "{}", a.status());
}

/// The `refused` of every report `cp` received, in order.
fn refusals(cp: &FakeControlPlane) -> Vec<Option<pb::DesiredRefused>> {
    cp.reports()
        .into_iter()
        .map(|r| r.report.and_then(|r| r.refused))
        .collect()
}

#[test]
fn a_refused_snapshot_is_answered_at_once_with_a_report_naming_the_refusal() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cp = FakeControlPlane::start().expect("cp");
    let forger = key("forger-1", 9);
    cp.answer_snapshots(Answer::Raw(signed(&forger, &snapshot(1, HOST, "data-1"))));

    let a = agent(dir.path(), &cp, &pin(dir.path(), &[&key("cp", 1)]));

    wait_for("a report", || !cp.reports().is_empty());
    let refused = refusals(&cp)[0].clone().expect("the refusal in the report");
    assert_eq!(refused.kind, "unknown_key");
    assert_eq!(refused.key_id, "forger-1");
    assert!(refused.reason.contains("does not trust"), "{refused:?}");
    assert!(!a.volume_exists("data-1"));
}

/// `snap` expiring `ago` before now (Unix ms).
fn expiring(mut snap: pb::Snapshot, ago: Duration) -> pb::Snapshot {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after 1970");
    snap.not_after_unix_ms = u64::try_from((now - ago).as_millis()).expect("ms");
    snap
}

#[test]
fn a_signed_snapshot_past_its_not_after_is_refused_as_expired() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cp = FakeControlPlane::start().expect("cp");
    let k = key("cp", 1);
    // What a man in the middle replays: signed, but stale.
    let stale = expiring(snapshot(1, HOST, "data-1"), Duration::from_secs(600));
    cp.answer_snapshots(Answer::Raw(signed(&k, &stale)));

    let a = agent(dir.path(), &cp, &pin(dir.path(), &[&k]));

    wait_for("a report", || !cp.reports().is_empty());
    let refused = refusals(&cp)[0].clone().expect("the refusal in the report");
    assert_eq!(refused.kind, "expired");
    assert_eq!(refused.key_id, "cp");
    assert!(!a.volume_exists("data-1"));
}

#[test]
fn a_signed_snapshot_within_the_skew_allowance_of_its_not_after_is_taken() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cp = FakeControlPlane::start().expect("cp");
    let k = key("cp", 1);
    let late = expiring(snapshot(1, HOST, "data-1"), Duration::from_secs(60));
    cp.answer_snapshots(Answer::Raw(signed(&k, &late)));

    let a = agent(dir.path(), &cp, &pin(dir.path(), &[&k]));

    a.wait_report("the volume", |r| has_volume(r, "data-1"));
}

/// The control plane answering `answer` for 3 s to an agent pinning a key
/// (a tick of 100 ms): how many snapshots it was asked for, and the
/// refusals the reports carried.
fn fetched_in_3_s(answer: Answer) -> (usize, Vec<Option<pb::DesiredRefused>>) {
    let dir = tempfile::tempdir().expect("tempdir");
    let cp = FakeControlPlane::start().expect("cp");
    cp.answer_snapshots(answer);
    let a = Agent::start(
        dir.path(),
        &[
            "--control-plane",
            &cp.url(),
            "--trusted-keys",
            pin(dir.path(), &[&key("cp", 1)]).to_str().expect("utf-8"),
            "--backoff-max",
            "60s",
        ],
    );

    std::thread::sleep(Duration::from_secs(3));

    let fetched = cp
        .requests()
        .iter()
        .filter(|r| r.path == "/v1/agent/snapshot")
        .count();
    let refused = refusals(&cp);
    drop(a);
    (fetched, refused)
}

#[test]
fn a_refused_answer_is_backed_off_like_no_answer_and_each_refusal_reported() {
    let (fetched, refused) = fetched_in_3_s(Answer::Snapshot(snapshot(1, HOST, "data-1")));

    // At the tick of 100 ms, 30 contacts in 3 s; backed off from it
    // (0.1, 0.2, 0.4, 0.8, 1.6 s, each with up to a tenth of jitter), 6.
    assert!((2..=8).contains(&fetched), "{fetched} fetches in 3 s");
    assert!(!refused.is_empty());
    assert!(
        refused
            .iter()
            .all(|r| r.as_ref().is_some_and(|r| r.kind == "unsigned"))
    );
}

#[test]
fn garbage_from_the_control_plane_is_backed_off_and_each_refusal_reported() {
    // A misconfigured proxy's page where a snapshot should be.
    let page = b"<html><body>502 Bad Gateway</body></html>".to_vec();

    let (fetched, refused) = fetched_in_3_s(Answer::Raw(page));

    assert!((2..=8).contains(&fetched), "{fetched} fetches in 3 s");
    assert!(!refused.is_empty());
    assert!(refused.iter().all(Option::is_some), "{refused:?}");
}

#[test]
fn a_good_answer_after_a_refused_one_clears_the_refusal_from_the_report() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cp = FakeControlPlane::start().expect("cp");
    let k = key("cp", 1);
    cp.answer_snapshots(Answer::Snapshot(snapshot(1, HOST, "data-1")));
    let a = agent(dir.path(), &cp, &pin(dir.path(), &[&k]));
    wait_for("a refusal reported", || {
        refusals(&cp).iter().any(Option::is_some)
    });

    cp.answer_snapshots(Answer::Raw(signed(&k, &snapshot(1, HOST, "data-1"))));
    a.wait_report("the volume", |r| has_volume(r, "data-1"));
    let seen = cp.reports().len();
    wait_for("a report after the good answer", || {
        cp.reports().len() > seen + 1
    });

    assert_eq!(refusals(&cp).last().cloned().flatten(), None);
}

#[test]
fn a_forged_answer_after_a_good_one_leaves_the_good_one_in_force() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cp = FakeControlPlane::start().expect("cp");
    let k = key("cp", 1);
    cp.answer_snapshots(Answer::Raw(signed(&k, &snapshot(1, HOST, "data-1"))));
    let a = agent(dir.path(), &cp, &pin(dir.path(), &[&k]));
    a.wait_report("the good snapshot", |r| has_volume(r, "data-1"));

    cp.answer_snapshots(Answer::Snapshot(snapshot(2, HOST, "data-2")));

    a.wait_refusal("not signed");
    let report = a.report();
    assert!(
        has_volume(&report, "data-1") && !has_volume(&report, "data-2"),
        "{report}"
    );
    assert!(!a.volume_exists("data-2"));
}

#[test]
fn a_snapshot_signed_by_an_unpinned_key_is_refused_naming_the_key() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cp = FakeControlPlane::start().expect("cp");
    let forger = key("forger-1", 9);
    cp.answer_snapshots(Answer::Raw(signed(&forger, &snapshot(1, HOST, "data-1"))));

    let a = agent(dir.path(), &cp, &pin(dir.path(), &[&key("cp", 1)]));

    a.wait_refusal("\"forger-1\", which this host does not trust");
    assert!(!a.volume_exists("data-1"));
}

#[test]
fn a_snapshot_changed_by_one_byte_after_signing_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cp = FakeControlPlane::start().expect("cp");
    let k = key("cp", 1);
    let bytes = snapshot(1, HOST, "data-1").encode_to_vec();
    let signature = k.sign(&bytes);
    // data-1 becomes data-2: still a valid snapshot, no longer the signed one.
    let mut tampered = bytes.clone();
    let at = tampered
        .windows(6)
        .position(|w| w == b"data-1")
        .expect("the id")
        + 5;
    tampered[at] = b'2';
    cp.answer_snapshots(Answer::Raw(
        pb::SignedSnapshot {
            snapshot: tampered,
            key_id: "cp".into(),
            signature,
        }
        .encode_to_vec(),
    ));

    let a = agent(dir.path(), &cp, &pin(dir.path(), &[&k]));

    a.wait_refusal("signature does not verify with key \"cp\"");
    assert!(!a.volume_exists("data-2") && !a.volume_exists("data-1"));
}

#[test]
fn a_snapshot_signed_for_another_host_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cp = FakeControlPlane::start().expect("cp");
    let k = key("cp", 1);
    cp.answer_snapshots(Answer::Raw(signed(
        &k,
        &snapshot(1, "another-host", "data-1"),
    )));

    let a = agent(dir.path(), &cp, &pin(dir.path(), &[&k]));

    a.wait_refusal("for host \"another-host\", not this host");
    assert!(!a.volume_exists("data-1"));
}

#[test]
fn a_replayed_older_signed_snapshot_is_fenced_and_not_acted_on() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cp = FakeControlPlane::start().expect("cp");
    let k = key("cp", 1);
    cp.answer_snapshots(Answer::Raw(signed(&k, &snapshot(5, HOST, "data-1"))));
    let a = agent(dir.path(), &cp, &pin(dir.path(), &[&k]));
    a.wait_report("epoch 5", |r| has_volume(r, "data-1"));

    cp.answer_snapshots(Answer::Raw(signed(&k, &snapshot(3, HOST, "data-2"))));

    a.wait_report("the fence", |r| r["report"]["fence_violation"] == true);
    assert!(!a.volume_exists("data-2"));
    assert!(a.status().contains("FENCED"), "{}", a.status());
}

#[test]
fn a_signed_epoch_reset_lowers_the_fence() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cp = FakeControlPlane::start().expect("cp");
    let k = key("cp", 1);
    cp.answer_snapshots(Answer::Raw(signed(&k, &snapshot(50, HOST, "data-1"))));
    let a = agent(dir.path(), &cp, &pin(dir.path(), &[&k]));
    a.wait_report("epoch 50", |r| has_volume(r, "data-1"));

    let restored = reset(2, 50, "data-2");
    cp.answer_snapshots(Answer::Raw(signed(&k, &restored)));

    a.wait_report("the reset", |r| has_volume(r, "data-2"));
    let epoch = std::fs::read_to_string(a.state.join("epoch")).expect("epoch");
    assert_eq!(epoch.trim(), "2");
}

/// A signed reset from 200 to 100 obeyed, the signer counted up to
/// `counted_to` since, then the same reset replayed: refused, `refusal` in
/// the notes, the fence and what the last snapshot named kept.
fn reset_replayed_at(counted_to: u64, refusal: &str) {
    let dir = tempfile::tempdir().expect("tempdir");
    let cp = FakeControlPlane::start().expect("cp");
    let k = key("cp", 1);
    cp.answer_snapshots(Answer::Raw(signed(&k, &snapshot(200, HOST, "data-1"))));
    let a = agent(dir.path(), &cp, &pin(dir.path(), &[&k]));
    a.wait_report("epoch 200", |r| has_volume(r, "data-1"));
    // Made once, after a restore: from 200 back to 100.
    let reset = signed(&k, &reset(100, 200, "data-2"));
    cp.answer_snapshots(Answer::Raw(reset.clone()));
    a.wait_report("the reset", |r| has_volume(r, "data-2"));
    let counted = snapshot(counted_to, HOST, "data-3");
    cp.answer_snapshots(Answer::Raw(signed(&k, &counted)));
    a.wait_report("the signer's count", |r| has_volume(r, "data-3"));

    cp.answer_snapshots(Answer::Raw(reset));

    a.wait_report("the replay refused", |r| {
        r["notes"].to_string().contains(refusal)
    });
    let report = a.report();
    assert!(has_volume(&report, "data-3"), "{report}");
    let epoch = std::fs::read_to_string(a.state.join("epoch")).expect("epoch");
    assert_eq!(epoch.trim(), counted_to.to_string());
}

#[test]
fn a_signed_epoch_reset_replayed_after_the_fence_moved_on_moves_nothing() {
    reset_replayed_at(150, "refusing a signed epoch reset to 100 from epoch 200");
}

#[test]
fn a_signed_epoch_reset_replayed_once_the_fence_counted_back_to_its_start_is_refused() {
    // Past where the reset was made, the reset's own check would pass it.
    reset_replayed_at(200, "this host obeyed that very reset before");
}

#[test]
fn a_signed_epoch_reset_that_never_expires_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cp = FakeControlPlane::start().expect("cp");
    let k = key("cp", 1);
    cp.answer_snapshots(Answer::Raw(signed(&k, &snapshot(50, HOST, "data-1"))));
    let a = agent(dir.path(), &cp, &pin(dir.path(), &[&k]));
    a.wait_report("epoch 50", |r| has_volume(r, "data-1"));

    let forever = pb::Snapshot {
        not_after_unix_ms: 0,
        ..reset(2, 50, "data-2")
    };
    cp.answer_snapshots(Answer::Raw(signed(&k, &forever)));

    a.wait_report("the reset refused", |r| {
        r["notes"].to_string().contains("that never expires")
    });
    let epoch = std::fs::read_to_string(a.state.join("epoch")).expect("epoch");
    assert_eq!(epoch.trim(), "50");
}

#[test]
fn a_key_is_rotated_by_pinning_both_then_dropping_the_old() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cp = FakeControlPlane::start().expect("cp");
    let (old, new) = (key("cp-2025", 1), key("cp-2026", 2));
    let keys = pin(dir.path(), &[&old, &new]);
    cp.answer_snapshots(Answer::Raw(signed(&old, &snapshot(1, HOST, "data-1"))));
    let a = agent(dir.path(), &cp, &keys);
    a.wait_report("the old key's snapshot", |r| has_volume(r, "data-1"));
    cp.answer_snapshots(Answer::Raw(signed(&new, &snapshot(2, HOST, "data-2"))));
    a.wait_report("the new key's snapshot", |r| has_volume(r, "data-2"));
    drop(a);

    let keys = pin(dir.path(), &[&new]);
    cp.answer_snapshots(Answer::Raw(signed(&old, &snapshot(3, HOST, "data-3"))));
    let a = agent(dir.path(), &cp, &keys);

    a.wait_refusal("\"cp-2025\", which this host does not trust");
    assert!(!a.volume_exists("data-3"));
    cp.answer_snapshots(Answer::Raw(signed(&new, &snapshot(3, HOST, "data-3"))));
    a.wait_report("the new key's next snapshot", |r| has_volume(r, "data-3"));
}

impl Agent {
    /// SIGHUP: the agent reads its pinned keys (and its desired state) again.
    fn hangup(&self) {
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGHUP,
        )
        .expect("SIGHUP");
    }

    fn log(&self, dir: &Path) -> String {
        std::fs::read_to_string(dir.join("agent.log")).unwrap_or_default()
    }
}

#[test]
fn a_key_pinned_while_the_agent_runs_is_trusted_after_a_sighup() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cp = FakeControlPlane::start().expect("cp");
    let (old, new) = (key("cp-2025", 1), key("cp-2026", 2));
    let keys = pin(dir.path(), &[&old]);
    cp.answer_snapshots(Answer::Raw(signed(&new, &snapshot(1, HOST, "data-1"))));
    let a = agent(dir.path(), &cp, &keys);
    a.wait_refusal("\"cp-2026\", which this host does not trust");

    pin(dir.path(), &[&old, &new]);
    a.hangup();

    a.wait_report("the new key's snapshot", |r| has_volume(r, "data-1"));
}

#[test]
fn a_key_dropped_while_the_agent_runs_is_refused_after_a_sighup() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cp = FakeControlPlane::start().expect("cp");
    let (old, new) = (key("cp-2025", 1), key("cp-2026", 2));
    let keys = pin(dir.path(), &[&old, &new]);
    cp.answer_snapshots(Answer::Raw(signed(&old, &snapshot(1, HOST, "data-1"))));
    let a = agent(dir.path(), &cp, &keys);
    a.wait_report("the old key's snapshot", |r| has_volume(r, "data-1"));

    pin(dir.path(), &[&new]);
    a.hangup();
    wait_for("the keys read again", || {
        a.log(dir.path()).contains("pinned keys are now cp-2026")
    });
    cp.answer_snapshots(Answer::Raw(signed(&old, &snapshot(2, HOST, "data-2"))));

    a.wait_refusal("\"cp-2025\", which this host does not trust");
    assert!(!a.volume_exists("data-2"));
}

#[test]
fn a_keys_file_that_no_longer_loads_keeps_the_keys_in_force_and_says_why() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cp = FakeControlPlane::start().expect("cp");
    let signer = key("cp-2026", 2);
    let keys = pin(dir.path(), &[&signer]);
    cp.answer_snapshots(Answer::Raw(signed(&signer, &snapshot(1, HOST, "data-1"))));
    let a = agent(dir.path(), &cp, &keys);
    a.wait_report("the first snapshot", |r| has_volume(r, "data-1"));

    std::fs::write(&keys, "ed25519 cp-2026 not-a-key\n").expect("a broken file");
    a.hangup();
    wait_for("the log to say why the keys stay", || {
        a.log(dir.path()).contains("kept the pinned keys cp-2026")
    });
    cp.answer_snapshots(Answer::Raw(signed(&signer, &snapshot(2, HOST, "data-2"))));

    a.wait_report("the next snapshot", |r| has_volume(r, "data-2"));
}

#[test]
fn standalone_a_file_refused_is_taken_once_its_key_is_pinned_and_sighup_sent() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (signing, pinned) = keygen(dir.path(), "pipeline");
    let pipeline = std::fs::read_to_string(&pinned).expect("its pin line");
    let other = key("other", 3).public_line();
    std::fs::write(&pinned, &other).expect("pin another key only");
    let desired = one_volume_desired(dir.path());
    let out = eitri(&[
        "sign",
        "--key",
        signing.to_str().expect("path"),
        desired.to_str().expect("path"),
    ]);
    assert!(out.status.success());
    let a = standalone(dir.path(), &desired, &pinned);
    a.wait_refusal("\"pipeline\", which this host does not trust");

    std::fs::write(&pinned, format!("{other}{pipeline}")).expect("pin both");
    a.hangup();

    a.wait_report("the volume", |r| has_volume(r, "data-1"));
}

#[test]
fn without_keys_an_unsigned_epoch_of_2_pow_64_minus_1_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cp = FakeControlPlane::start().expect("cp");
    cp.answer_snapshots(Answer::Snapshot(snapshot(u64::MAX, HOST, "data-1")));
    let a = Agent::start(dir.path(), &["--control-plane", &cp.url()]);

    a.wait_report("the refusal note", |r| {
        r["notes"].as_array().is_some_and(|n| {
            n.iter().any(|n| {
                n.as_str()
                    .is_some_and(|n| n.contains("may not move the fence"))
            })
        })
    });
    assert!(!a.volume_exists("data-1"));
    assert!(a.status().contains("unauthenticated"), "{}", a.status());

    // The real control plane, at its real epoch, is not fenced out.
    cp.answer_snapshots(Answer::Snapshot(snapshot(1, HOST, "data-2")));
    a.wait_report("the real snapshot", |r| has_volume(r, "data-2"));
}

#[test]
fn without_keys_an_unsigned_jump_past_max_epoch_step_is_refused_and_counted() {
    let dir = tempfile::tempdir().expect("tempdir");
    let metrics = dir.path().join("eitri.prom");
    let cp = FakeControlPlane::start().expect("cp");
    cp.answer_snapshots(Answer::Snapshot(snapshot(10, HOST, "data-1")));
    let a = Agent::start(
        dir.path(),
        &[
            "--control-plane",
            &cp.url(),
            "--max-epoch-step",
            "100",
            "--metrics-file",
            metrics.to_str().expect("path"),
        ],
    );
    a.wait_report("the first snapshot", |r| has_volume(r, "data-1"));

    cp.answer_snapshots(Answer::Snapshot(snapshot(111, HOST, "data-2")));

    a.wait_report("the refusal note", |r| {
        r["notes"].as_array().is_some_and(|n| {
            n.iter().any(|n| {
                n.as_str()
                    .is_some_and(|n| n.contains("more than 100 (--max-epoch-step) above"))
            })
        })
    });
    assert!(!a.volume_exists("data-2"));
    wait_for("the refusal counted", || {
        std::fs::read_to_string(&metrics)
            .is_ok_and(|m| m.contains("eitri_epoch_refusals_total{kind=\"too_far\"} "))
    });
    // A step within the bound is taken.
    cp.answer_snapshots(Answer::Snapshot(snapshot(110, HOST, "data-3")));
    a.wait_report("the next snapshot", |r| has_volume(r, "data-3"));
}

/// `eitri-agent sign --key KEY [EXTRA…] DESIRED`, which must succeed.
fn sign(key: &Path, desired: &Path, extra: &[&str]) {
    let mut args = vec!["sign", "--key", key.to_str().expect("path")];
    args.extend_from_slice(extra);
    args.push(desired.to_str().expect("path"));
    let out = eitri(&args);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn eitri(args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .env_clear()
        .output()
        .expect("run eitri-agent")
}

/// `keygen` into `dir/NAME.key`, pinning what it prints in `dir/trusted`.
fn keygen(dir: &Path, id: &str) -> (PathBuf, PathBuf) {
    let key = dir.join(format!("{id}.key"));
    let out = eitri(&["keygen", "--id", id, "--out", key.to_str().expect("path")]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let pinned = dir.join("trusted");
    std::fs::write(&pinned, &out.stdout).expect("pin");
    (key, pinned)
}

/// `dir/desired.json`, unsigned, naming the volume `data-1` at epoch 1.
fn one_volume_desired(dir: &Path) -> PathBuf {
    let desired = dir.join("desired.json");
    write_desired(
        &desired,
        &format!(
            r#"{{"epoch":1,"host_id":"{HOST}","volumes":[{{"volume_id":"data-1","size_gb":1}}]}}"#
        ),
    );
    desired
}

fn write_desired(path: &Path, json: &str) {
    let temp = path.with_extension("tmp");
    std::fs::write(&temp, json).expect("desired");
    std::fs::rename(temp, path).expect("rename");
}

fn standalone(dir: &Path, desired: &Path, pinned: &Path) -> Agent {
    Agent::start(
        dir,
        &[
            "--desired",
            desired.to_str().expect("path"),
            "--trusted-keys",
            pinned.to_str().expect("path"),
        ],
    )
}

#[test]
fn sign_stamps_a_week_of_validity_into_the_file_it_signs() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (key, _) = keygen(dir.path(), "pipeline");
    let desired = dir.path().join("desired.json");
    write_desired(&desired, &format!(r#"{{"epoch":1,"host_id":"{HOST}"}}"#));
    let before = eitri_agent::human::unix_ms(std::time::SystemTime::now());

    sign(&key, &desired, &[]);

    let text = std::fs::read_to_string(&desired).expect("desired");
    let file: serde_json::Value = serde_json::from_str(&text).expect("json");
    let week = 7 * 24 * 3600 * 1000;
    let until = file["not_after_unix_ms"].as_u64().expect("stamped");
    assert!(
        (before + week..before + week + 60_000).contains(&until),
        "{text}"
    );
}

#[test]
fn sign_with_valid_for_0_keeps_the_files_own_expiry_which_the_agent_holds_it_to() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (key, pinned) = keygen(dir.path(), "pipeline");
    let desired = one_volume_desired(dir.path());
    // Older than the skew the agent allows, once signed.
    let stale = format!(
        "{{\"not_after_unix_ms\": {}, \"epoch\":1,\"host_id\":\"{HOST}\",\"volumes\":[{{\"volume_id\":\"data-1\",\"size_gb\":1}}]}}",
        eitri_agent::human::unix_ms(std::time::SystemTime::now()) - 3_600_000
    );
    write_desired(&desired, &stale);
    sign(&key, &desired, &["--valid-for", "0"]);

    let a = standalone(dir.path(), &desired, &pinned);

    a.wait_refusal("expired");
    assert!(!a.volume_exists("data-1"));
}

#[test]
fn standalone_a_file_signed_with_sign_is_acted_on() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (key, pinned) = keygen(dir.path(), "pipeline");
    let desired = one_volume_desired(dir.path());

    sign(&key, &desired, &[]);
    let a = standalone(dir.path(), &desired, &pinned);

    a.wait_report("the volume", |r| has_volume(r, "data-1"));
}

#[test]
fn standalone_an_unsigned_file_is_refused_naming_sign() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (_, pinned) = keygen(dir.path(), "pipeline");
    let desired = one_volume_desired(dir.path());

    let a = standalone(dir.path(), &desired, &pinned);

    a.wait_refusal("eitri-agent sign --key KEY");
    assert!(!a.volume_exists("data-1"));
}

#[test]
fn standalone_a_file_changed_after_signing_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (key, pinned) = keygen(dir.path(), "pipeline");
    let desired = dir.path().join("desired.json");
    let text = format!(
        r#"{{"epoch":1,"host_id":"{HOST}","volumes":[{{"volume_id":"data-1","size_gb":1}}]}}"#
    );
    write_desired(&desired, &text);
    let out = eitri(&[
        "sign",
        "--key",
        key.to_str().expect("path"),
        desired.to_str().expect("path"),
    ]);
    assert!(out.status.success());
    write_desired(&desired, &text.replace("data-1", "data-2"));

    let a = standalone(dir.path(), &desired, &pinned);

    a.wait_refusal("signature does not verify");
    assert!(!a.volume_exists("data-2"));
}

/// `eitri-agent sign --key KEY --embed FILE`, which must succeed.
fn sign_embedded(key: &Path, file: &Path) {
    let out = eitri(&[
        "sign",
        "--key",
        key.to_str().expect("path"),
        "--embed",
        file.to_str().expect("path"),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `eitri-agent sign --key KEY FILE`, which must refuse (exit 1) and
/// write no signature: what it said.
fn sign_refused(key: &Path, file: &Path) -> String {
    let out = eitri(&[
        "sign",
        "--key",
        key.to_str().expect("path"),
        file.to_str().expect("path"),
    ]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(!FileSource::signature_path(file).exists());
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// A key made in `dir` (its secret, its pinned line) and a desired file
/// naming volume data-1 that carries its signature.
fn embedded_file(dir: &Path) -> (PathBuf, PathBuf, PathBuf) {
    let (key, pinned) = keygen(dir, "pipeline");
    let desired = dir.join("desired.json");
    write_desired(&desired, &one_volume("data-1"));
    sign_embedded(&key, &desired);
    (key, pinned, desired)
}

fn one_volume(volume: &str) -> String {
    format!(
        r#"{{"epoch":1,"host_id":"{HOST}","volumes":[{{"volume_id":"{volume}","size_gb":1}}]}}"#
    )
}

#[test]
fn standalone_a_file_that_carries_its_signature_is_acted_on() {
    let dir = tempfile::tempdir().expect("tempdir");

    let (_, pinned, desired) = embedded_file(dir.path());
    let a = standalone(dir.path(), &desired, &pinned);

    a.wait_report("the volume", |r| has_volume(r, "data-1"));
    assert!(!dir.path().join("desired.json.sig").exists());
}

#[test]
fn standalone_a_file_changed_below_its_own_signature_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (_, pinned, desired) = embedded_file(dir.path());
    let signed = std::fs::read_to_string(&desired).expect("signed");
    write_desired(&desired, &signed.replace("data-1", "data-2"));

    let a = standalone(dir.path(), &desired, &pinned);

    a.wait_refusal("signature does not verify");
    assert!(!a.volume_exists("data-2"));
}

#[test]
fn signing_a_file_that_carries_its_signature_again_replaces_the_line() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (key, pinned, desired) = embedded_file(dir.path());
    let signed = std::fs::read_to_string(&desired).expect("signed");
    write_desired(&desired, &signed.replace("data-1", "data-2"));

    sign_embedded(&key, &desired);
    let a = standalone(dir.path(), &desired, &pinned);

    a.wait_report("the volume", |r| has_volume(r, "data-2"));
    let text = std::fs::read_to_string(&desired).expect("signed");
    assert_eq!(
        text.lines().filter(|l| l.starts_with("ed25519 ")).count(),
        1,
        "{text}"
    );
}

#[test]
fn sign_without_embed_refuses_a_file_that_carries_its_signature() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (key, _, desired) = embedded_file(dir.path());

    let said = sign_refused(&key, &desired);

    assert!(said.contains("--embed"), "{said}");
}

#[test]
fn a_host_without_keys_takes_what_a_file_signs_below_its_signature() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (_, _, desired) = embedded_file(dir.path());

    let a = Agent::start(dir.path(), &["--desired", desired.to_str().expect("path")]);

    a.wait_report("the volume", |r| has_volume(r, "data-1"));
}

#[test]
fn keygen_never_overwrites_a_key() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (key, _) = keygen(dir.path(), "pipeline");
    let before = std::fs::read(&key).expect("key");

    let out = eitri(&[
        "keygen",
        "--id",
        "other",
        "--out",
        key.to_str().expect("path"),
    ]);

    assert_eq!(out.status.code(), Some(1));
    assert_eq!(std::fs::read(&key).expect("key"), before);
}

#[test]
fn sign_refuses_a_file_that_names_no_host_and_writes_no_signature() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (key, _) = keygen(dir.path(), "pipeline");
    let desired = dir.path().join("desired.json");
    write_desired(&desired, r#"{"epoch":1,"volumes":[]}"#);

    let said = sign_refused(&key, &desired);

    assert!(said.contains("names no host_id"), "{said}");
}

#[test]
fn keygen_and_sign_each_have_a_help_of_their_own() {
    let keygen = eitri(&["keygen", "--help"]);
    let sign = eitri(&["sign", "--help"]);

    let (keygen, sign) = (
        String::from_utf8_lossy(&keygen.stdout),
        String::from_utf8_lossy(&sign.stdout),
    );
    assert!(
        keygen.starts_with("usage: eitri-agent keygen --id"),
        "{keygen}"
    );
    assert!(sign.starts_with("usage: eitri-agent sign --key"), "{sign}");
    assert!(!sign.contains("eitri-agent run"), "{sign}");
}

#[test]
fn keys_with_a_token_over_plain_http_stop_the_start_naming_the_choices() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().expect("tempdir");
    let token = dir.path().join("token");
    std::fs::write(&token, "s3cret\n").expect("token");
    std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    let pinned = pin(dir.path(), &[&key("cp", 1)]);

    let out = eitri(&[
        "run",
        "--control-plane",
        "http://127.0.0.1:9",
        "--state-dir",
        dir.path().join("state").to_str().expect("path"),
        "--token-file",
        token.to_str().expect("path"),
        "--trusted-keys",
        pinned.to_str().expect("path"),
    ]);

    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("--token-in-clear yes") && stderr.contains("https://"),
        "{stderr}"
    );
}
