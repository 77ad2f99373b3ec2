//! Creating a VM: host key, admission, then image → root disk → seed → boot,
//! narrated as it goes.
//!
//! Order, and why:
//! 0. A hypervisor of this VM already alive (a crash came between its start
//!    and its record) is adopted: the create is recorded as done.
//! 1. A spec change starts the budget over. An attempt is made only when
//!    the lifecycle says one is due: a failed one waits out its backoff, a
//!    budget spent on transient errors waits for its re-arm, a permanent
//!    error waits for a new spec (see `lifecycle`). A create that met a
//!    full filesystem waits for more room there, or a minute.
//! 2. With `host_cert_required`, the host key is loaded or made; without a
//!    certificate yet, its public line is saved and the pass waits for one
//!    (with one, the attempt's save in 4 records the line).
//! 3. Admission against the host caps. A refusal spends no attempt.
//! 4. The attempt is counted and saved **before** any side effect, so a
//!    crash mid-create still counts against the budget; its save is made
//!    durable beside the root disk, before the VMM starts
//!    (`Store::save_visible`), so a host that crashes booting the VM finds
//!    the attempt counted too. Beside the save, the VM's address and VMM
//!    id are taken (`Create::count_attempt` says why that is no side
//!    effect the count must precede), their tables' names made durable
//!    with the record's.
//! 5. Preflight, a create slot (bounded by the deadline), the image, the root
//!    disk, the seed, and (when desired running) the volumes check and boot.
//! 6. Success writes the boot id, the create's completion witness; the
//!    row is said before the record follows (the spine's
//!    [`Next::Announce`]), and a VM wanted suspended is suspended next.
//!
//! A failure before the deadline spends the attempt; a permanent one spends
//! the whole budget; a failure after the deadline refunds the attempt (the
//! VM only ran out of time, e.g. queued for a slot), and the refund wins
//! over permanence: the next pass, with a fresh deadline, meets the
//! permanent error again and ends it properly.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::admission::CreateSlots;
use super::clones;
use super::context::{Context, panicked};
use super::lifecycle::{self, Attempts, State};
use super::pass::{Began, CREATE_STAGE, Narrator, Next, Pass, VmResult};
use super::seams::{HostKey, HostKeys, ImageRequest, Images, Progress, SeedBuilder, SeedParams};
use super::volumes;
use crate::deadline::Deadline;
use crate::error::{BoxFailure, Outcome, Simple, chain};
use crate::model::{DesiredVm, Id, Mac, Phase, PowerState};
use crate::stages::{span, timed};
use crate::state::atomic::Pending;
use crate::state::{Record, Unsynced};

/// What only a create uses: where its image, seed and host key come from,
/// the slots that bound creates at once, and the creates that wait for
/// the host.
pub(crate) struct Create {
    pub images: Arc<dyn Images>,
    pub seed: Arc<dyn SeedBuilder>,
    pub host_keys: Arc<dyn HostKeys>,
    pub slots: CreateSlots,
    /// The VMs whose create waits for the host to be fixed (a full
    /// filesystem, an image server out of reach, what the backend lacks),
    /// with what the row of each says: the host's condition while any waits.
    waiting: parking_lot::Mutex<BTreeMap<Id, Waiting>>,
}

/// A VM whose create waits for the host to be fixed.
#[derive(Clone, Debug)]
struct Waiting {
    /// What its row says.
    said: String,
    /// For a full filesystem: how many bytes it had free when the create
    /// met it, and when. The create is tried again only once there is
    /// more room, or a while later (a quota, which the free bytes do not
    /// show, may have been raised): an attempt on an unchanged full disk
    /// would only fail again, and write its record twice doing so.
    full: Option<(u64, std::time::SystemTime)>,
}

impl Create {
    pub(crate) fn new(
        images: Arc<dyn Images>,
        seed: Arc<dyn SeedBuilder>,
        host_keys: Arc<dyn HostKeys>,
        slots: CreateSlots,
    ) -> Create {
        Create {
            images,
            seed,
            host_keys,
            slots,
            waiting: parking_lot::Mutex::default(),
        }
    }

    /// What the host lacks for the creates that wait for it, as the
    /// host's status says it: the first VM's, and how many more wait.
    pub(crate) fn host_condition(&self) -> Option<String> {
        let waiting = self.waiting.lock();
        let (vm_id, Waiting { said, .. }) = waiting.first_key_value()?;
        let others = match waiting.len() - 1 {
            0 => String::new(),
            n => format!(" (and {n} more VMs wait)"),
        };
        Some(format!("VM {vm_id} cannot be created: {said}{others}"))
    }

    /// The VM is gone: its create waits for nothing.
    pub(crate) fn forget(&self, vm_id: &Id) {
        self.waiting.lock().remove(vm_id);
    }

    /// One create pass for `d` (the steps in the module's header), each
    /// stage a function below.
    pub(crate) fn run(
        &self,
        ctx: &Context,
        d: &DesiredVm,
        prior: Option<&Record>,
        pass: &mut Pass<'_>,
    ) -> Next {
        let vm_id = &d.spec.vm_id;
        let now = ctx.host.now();
        let mut rec = wanted_record(d, prior);
        if let Some(next) = adopted(ctx, d, &mut rec, pass) {
            return next;
        }
        if !attempt_due(ctx, &mut rec, now) || self.still_full(ctx, vm_id, now) {
            ctx.report_recorded(pass.res, &rec, PowerState::Stopped);
            return Next::Done;
        }
        let mut attempt = Attempt {
            ctx,
            create: self,
            deadline: pass.deadline,
            counted: false,
            waited: rec
                .lifecycle
                .waiting_for_host()
                .then(|| rec.lifecycle.last_error().to_owned()),
        };
        let host_key = match self.host_key(ctx, d, &mut rec, pass.res) {
            Ok(HostKeyStage::Go(key)) => key,
            Ok(HostKeyStage::AwaitingCertificate) => return Next::Done,
            Err(e) => return attempt.fail(rec, e, pass.res),
        };
        if let Some(template) = &d.spec.clone_of {
            match clones::template(ctx, template, pass.template_wanted) {
                clones::Template::Ready => {}
                clones::Template::NotYet(what) => {
                    pass.res.report(
                        &rec,
                        Some(PowerState::Stopped),
                        Phase::Creating,
                        format!("waiting for {what}"),
                    );
                    return Next::Done;
                }
                clones::Template::Gone(why) => {
                    return attempt.fail(rec, Simple::permanent(why).into(), pass.res);
                }
            }
        }
        // Descriptors the agent would hold for it (its ports' sockets are
        // asked for as they are held): short, it waits as the host's to
        // fix, and no create of another VM runs out of them. Claimed for
        // the rest of the attempt, which opens them.
        let _fds = match ctx.ledger.descriptors(super::FDS_PER_VM) {
            Ok(claim) => claim,
            Err(short) => {
                let why = format!("waits for file descriptors: {short}");
                return attempt.wait_for_host(rec, why, pass.res);
            }
        };
        // A refusal is no attempt and no record of one: reported failed,
        // as the reference does, and retried at the next tick.
        if let Err(why) = timed("admission", || ctx.ledger.admit(&rec.spec)) {
            let why = why.to_string();
            pass.res
                .report(&rec, Some(PowerState::Stopped), Phase::Failed, why);
            return Next::Done;
        }
        // Whether this host can run a guest at all, before an attempt is
        // counted: what the host lacks spends none (see `Attempt::fail`).
        let preflight = timed("preflight", || ctx.backend.preflight(pass.deadline));
        if let Err(e) = &preflight
            && e.is_host_condition()
        {
            let error = chain(&**e);
            return attempt.wait_for_host(rec, error, pass.res);
        }
        let before = rec.clone();
        rec.begin_attempt(now);
        let _create = span(CREATE_STAGE);
        // A VM wanted suspended is booted, then suspended: a guest that
        // never ran has no state to save.
        let boots = d.power != PowerState::Stopped;
        let (unsynced, reserved) = count_attempt(ctx, &rec, boots && preflight.is_ok());
        let unsynced = match unsynced {
            Ok(unsynced) => unsynced,
            Err(e) => return attempt.fail(before, e, pass.res),
        };
        attempt.counted = true;
        ctx.counts.create_attempts.inc();
        crate::crash::point("create.attempt-saved");

        let narrator = pass.narrator(&rec, PowerState::Stopped, Phase::Creating);
        let built = preflight.and(reserved).and_then(|reserved| {
            let names = NotYetDurable { unsynced, reserved };
            self.build(ctx, d, &mut rec, host_key, names, &narrator)
        });
        let Built { boots, guest_said } = match built {
            Ok(built) => built,
            Err(e) => return attempt.fail(rec, e, pass.res),
        };
        pass.res.guest_said = guest_said;
        rec.created(ctx.host.boot_id(), boots);
        self.forget(vm_id);
        ctx.counts.lost.touch(vm_id.as_str());
        pass.res
            .report(&rec, Some(PowerState::observed(boots)), Phase::Ready, "");
        Next::Announce(rec, Began::Created(crate::crash::at("create.booted-saved")))
    }

    /// A clone's side effects, once its attempt is counted (see
    /// [`clones`]): its seed made, and its disk and saved guest copied
    /// from its template's, while the attempt is made durable; then its
    /// template's guest restored as its own, and made its own by its
    /// guest agent. Never booted. It holds its create slot throughout: a
    /// burst of clones given their slots back after the copies ran 20
    /// real guests' identities at once on two cores, and they missed their
    /// deadline attempt after attempt (`make bench-clone`).
    #[allow(clippy::too_many_arguments)]
    fn build_clone(
        &self,
        ctx: &Context,
        d: &DesiredVm,
        rec: &mut Record,
        template: &Id,
        host_key: HostKey,
        attempt: NotYetDurable,
        narrator: &Narrator,
    ) -> Outcome<Option<crate::guest::Status>> {
        let deadline = narrator.deadline();
        let vm_id = &d.spec.vm_id;
        let Some(suspender) = ctx.backend.suspender() else {
            return Err(Simple::permanent(format!(
                "VM {vm_id}: this host's hypervisor cannot save a guest, so it cannot clone one"
            ))
            .into());
        };
        narrator.say(&format!("copying its template {template}"));
        let spec = &rec.spec;
        let method = parking_lot::Mutex::new(None);
        let copy = || {
            let copied = timed("clone copy", || {
                suspender.clone_saved(template, spec, deadline)
            })?;
            crate::crash::point("create.clone-copied");
            *method.lock() = Some(copied);
            Ok(Pending::none())
        };
        let own = clones::Own {
            hostname: clones::hostname(d),
            host_key_pem: host_key.private_pem.clone(),
            host_key_public: host_key.public_line.clone(),
            host_certificate: d.ssh_host_cert.clone(),
            authorized_keys: Some(&d.spec.ssh_authorized_key)
                .filter(|k| !k.is_empty())
                .cloned()
                .into_iter()
                .collect(),
            nics: clones::nics(&*ctx.backend, d, template),
        };
        let made = self.prepare(ctx, spec, copy, &seed_params(d, Some(host_key)), attempt)?;
        if *method.lock() == Some(crate::disk::Method::SparseCopy) {
            log::warn!(
                "VM {vm_id}: its template's disk and memory were copied whole: the state dir's filesystem shares no extents (XFS or btrfs would reflink them in a moment)"
            );
        }
        narrator.say(&format!("restoring its template {template}'s guest"));
        let restoring = std::time::Instant::now();
        start_syncing(ctx, vm_id, made, deadline, || {
            timed("restore", || suspender.resume(spec, deadline, &|| Ok(())))
        })?;
        let ran = std::time::Instant::now();
        crate::crash::point("create.clone-restored");
        narrator.say("making it a machine of its own through its guest agent");
        let status = match timed("own", || {
            clones::make_own(&*ctx.backend, vm_id, &own, ran, deadline)
        }) {
            Ok(made) => {
                log::info!(
                    "VM {vm_id}: cloned from {template}: restored and made its own {} ms after its restore began; {}",
                    restoring.elapsed().as_millis(),
                    made.said
                );
                made.status
            }
            Err(why) => {
                let say = |_: &str| {};
                if let Err(stop) = ctx.backend.shutdown(vm_id, deadline, &say) {
                    log::error!(
                        "VM {vm_id}: cannot stop the hypervisor of a clone that is not its own: {}",
                        chain(&*stop)
                    );
                }
                return Err(Simple::transient(format!(
                    "VM {vm_id}: its copy of {template} was not made a machine of its own: {why}; its hypervisor is stopped (a copy of its template never runs as this VM)"
                ))
                .into());
            }
        };
        crate::crash::point("create.clone-own");
        ctx.note_address(rec);
        Ok(status)
    }

    /// Whether the VM waits for room on a filesystem that has no more of
    /// it than when its create last met it full (and not for long: see
    /// [`Waiting::full`]).
    fn still_full(&self, ctx: &Context, vm_id: &Id, now: std::time::SystemTime) -> bool {
        let Some((free, since)) = self.waiting.lock().get(vm_id).and_then(|w| w.full) else {
            return false;
        };
        let grown = crate::state::Room::at(ctx.store.root())
            .is_none_or(|room| room.free > free.saturating_add(ROOM_GROWN));
        !grown && now < since + ROOM_RECHECK
    }

    /// The VM's host key (step 2), when it is to present a certificate:
    /// loaded or made, its public line in the record and the result; the
    /// pass stops here, saying so, until the certificate is in the desired
    /// state.
    fn host_key(
        &self,
        ctx: &Context,
        d: &DesiredVm,
        rec: &mut Record,
        res: &mut VmResult,
    ) -> Outcome<HostKeyStage> {
        // A clone always has a key of the agent's making: the one its
        // template's guest made for itself is its template's.
        if !d.host_cert_required && d.spec.clone_of.is_none() {
            return Ok(HostKeyStage::Go(None));
        }
        let key = timed("host key", || {
            self.host_keys
                .load_or_create(&ctx.store.layout().host_key(&d.spec.vm_id))
        })?;
        let awaiting = d.host_cert_required && d.ssh_host_cert.is_empty();
        if rec.host_pubkey != key.public_line {
            rec.host_pubkey = key.public_line.clone();
            // Saved here only when the pass stops here to wait for the
            // certificate; otherwise the attempt's own save, before any
            // side effect, carries it (one fsync pair fewer per create).
            if awaiting {
                ctx.store.save(rec)?;
            }
        }
        res.host_pubkey = rec.host_pubkey.clone();
        if awaiting {
            res.report(
                rec,
                Some(PowerState::Stopped),
                Phase::Creating,
                "awaiting host certificate",
            );
            return Ok(HostKeyStage::AwaitingCertificate);
        }
        Ok(HostKeyStage::Go(Some(key)))
    }

    /// The attempt's side effects (step 5), once it is counted: a create
    /// slot, the image, the root disk and seed, and for a VM to run, its
    /// volumes and its boot.
    fn build(
        &self,
        ctx: &Context,
        d: &DesiredVm,
        rec: &mut Record,
        host_key: Option<HostKey>,
        attempt: NotYetDurable,
        narrator: &Narrator,
    ) -> Outcome<Built> {
        let deadline = narrator.deadline();
        // Bounds how much create concurrency reaches the disk: N parallel
        // creates are N downloads and N multi-GB copies on one device, which
        // can starve the state dir and fill the disk with temporaries. A
        // queued VM says so and waits, at most until its deadline, and a
        // deadline failure is refunded: waiting costs it no attempt.
        narrator.say("waiting for a create slot on this host");
        let slot = timed("create slot", || self.slots.acquire(deadline))?;
        if let Some(template) = &d.spec.clone_of {
            let host_key = host_key.ok_or_else(|| {
                Simple::transient(format!("VM {}: a clone has no host key", d.spec.vm_id))
            })?;
            let guest_said =
                self.build_clone(ctx, d, rec, template, host_key, attempt, narrator)?;
            drop(slot);
            return Ok(Built {
                boots: true,
                guest_said,
            });
        }

        narrator.say("downloading image");
        let progress: Progress = {
            let narrator = narrator.clone();
            Arc::new(move |done, total| narrator.say(&download_detail(done, total)))
        };
        // The image becomes the root disk: it may be no larger.
        let max_bytes = d.spec.disk_gb.saturating_mul(1 << 30);
        let base = timed("image", || {
            self.images.resolve(ImageRequest {
                url: &d.spec.image_url,
                sha256: &d.spec.image_sha256,
                max_bytes,
                deadline,
                progress,
            })
        })?;
        let boots = d.power != PowerState::Stopped;
        narrator.say("preparing root disk and seed");
        let spec = &rec.spec;
        let disk = || {
            timed("root disk", || {
                ctx.backend.prepare_root_disk(spec, &base.path, deadline)
            })
            .inspect(|_| crate::crash::point("create.disk-prepared"))
        };
        let made = self.prepare(ctx, spec, disk, &seed_params(d, host_key), attempt)?;
        // The root disk is made: the image may be pruned from here.
        drop(base);

        if boots {
            let live = |other: &Id| ctx.backend.running(other);
            volumes::materialized(&ctx.store, &rec.spec, &live)?;
            boot_syncing(ctx, &rec.spec, made, deadline, narrator)?;
            ctx.note_address(rec);
        } else {
            sync_made(&rec.spec.vm_id, made)?;
        }
        // The heavy part is over; the record write that follows needs no
        // slot.
        drop(slot);
        Ok(Built {
            boots,
            guest_said: None,
        })
    }

    /// The root disk and the seed, made while the attempt's record and
    /// the host's share are made durable (`make bench-create`, the `root
    /// disk`, `seed`, `record sync` and `reserve sync` stages beside
    /// `prepare`). Both are durable when this returns: a host that
    /// crashes booting this VM must find the attempt counted, or it would
    /// boot it again, and again, without end, and no other VM may be
    /// handed the address or id its VMM holds. The
    /// root disk and seed are in place, and durable once the returned
    /// [`Pending`] is synced (see [`boot_syncing`]). The first error,
    /// in that order, is the create's.
    fn prepare(
        &self,
        ctx: &Context,
        spec: &crate::model::VmSpec,
        disk: impl FnOnce() -> Outcome<Pending> + Send,
        params: &SeedParams,
        attempt: NotYetDurable,
    ) -> Outcome<Pending> {
        let vm_id = &spec.vm_id;
        let _prepare = span("prepare");
        // The seed is the quickest to make: the share's names are synced
        // after it, on its thread.
        let seed = || -> Outcome<Pending> {
            let seed = timed("seed", || {
                self.seed.build(&ctx.store.layout().seed(vm_id), params)
            })
            .inspect(|_| crate::crash::point("create.seed-built"))?;
            timed("reserve sync", || attempt.reserved.sync()).map_err(|e| {
                Simple::transient(format!(
                    "VM {vm_id}: cannot make its address or VMM id durable: {e}"
                ))
            })?;
            Ok(seed)
        };
        let durable = || ctx.store.make_durable(attempt.unsynced);
        let (seed, (durable, disk)) =
            crate::threads::alongside(&format!("seed-{vm_id}"), seed, || {
                crate::threads::alongside(&format!("record-{vm_id}"), durable, disk)
            });
        let disk = disk?;
        let seed = seed.map_err(|why| panicked("building the seed", why))??;
        durable.map_err(|why| panicked("syncing the attempt's record", why))??;
        Ok(disk.and(seed))
    }
}

/// Step 0: a hypervisor of this VM already running, provably its own
/// (left by a crash between its start and the record saying so, or a
/// record deleted under it): the create happened; it is recorded as done,
/// no attempt spent, no disk touched, never started twice. The backend
/// says so; the engine never guesses. Except a clone's: until its create
/// is recorded it may still be its template's copy, never made its own,
/// so it is stopped and the clone made again. How the pass ends, when it
/// ends here.
fn adopted(ctx: &Context, d: &DesiredVm, rec: &mut Record, pass: &mut Pass<'_>) -> Option<Next> {
    let vm_id = &d.spec.vm_id;
    if !ctx.backend.adopt(vm_id) {
        return None;
    }
    if d.spec.clone_of.is_none() {
        rec.created(ctx.host.boot_id(), true);
        ctx.save_best_effort(rec);
        log::warn!("VM {vm_id}: its hypervisor was already running; adopted it as created");
        ctx.report_recorded(pass.res, rec, PowerState::Running);
        return Some(Next::Done);
    }
    log::warn!(
        "VM {vm_id}: a hypervisor of this clone was running before its create was recorded; it may still be its template's copy, so it is stopped and the clone made again"
    );
    let stopped = ctx.backend.shutdown(vm_id, pass.deadline, &|_| {});
    let e = stopped.err()?;
    let why = format!(
        "cannot stop a clone's hypervisor found running before its create was recorded: {}",
        chain(&*e)
    );
    pass.res
        .report(rec, Some(PowerState::Running), Phase::Failed, why);
    Some(Next::Done)
}

/// Saves the attempt (step 4) and, for a VM about to boot, takes the
/// host's share of it ([`Lifecycle::reserve`]: its address and its
/// VMM's id), at once: two durable writes made together wait for one
/// journal commit, where one after the other they were two waits on
/// the way to the VMM (`make bench-create`, the `record save` and
/// `reserve` stages). The record is in place and its bytes durable
/// when this returns, and so are the share's tables'; their names are
/// made durable beside the root disk (see [`Create::prepare`]): one
/// fsync wait before the VMM with nothing beside it.
///
/// The share is bookkeeping of the agent's own, which touches neither
/// the guest nor the host's devices, so taking it beside the save
/// breaks no "counted before any side effect": a crash between the
/// two leaves a share held by a VM with no record, which the next
/// agent gives back at its start (the backend's `recover`), and the
/// create that runs again takes it again (the leases are sticky).
///
/// [`Lifecycle::reserve`]: crate::provision::Lifecycle::reserve
fn count_attempt(
    ctx: &Context,
    rec: &Record,
    reserve: bool,
) -> (Outcome<Unsynced>, Outcome<Pending>) {
    let take = || {
        if reserve {
            timed("reserve", || ctx.backend.reserve(&rec.spec))
                .inspect(|_| crate::crash::point("create.reserved"))
        } else {
            Ok(Pending::none())
        }
    };
    let thread = format!("reserve-{}", rec.spec.vm_id);
    ctx.save_beside(rec, (&thread, "reserving the host's share"), take)
}

/// Whether the lifecycle says an attempt is due now (step 1): a budget
/// spent on errors that may pass is re-armed once its time has come.
fn attempt_due(ctx: &Context, rec: &mut Record, now: std::time::SystemTime) -> bool {
    match lifecycle::state(rec, ctx.budget()) {
        State::Creating(Attempts::Open { due: None } | Attempts::WaitingForHost) => true,
        State::Creating(Attempts::Open { due: Some(due) }) => due <= now,
        State::Creating(Attempts::Spent { rearm_at }) if rearm_at <= now => {
            log::info!(
                "VM {}: its create budget, spent on errors that may pass, is re-armed",
                rec.spec.vm_id
            );
            rec.rearm();
            true
        }
        // Not yet: the record says why and when.
        State::Creating(Attempts::Spent { .. } | Attempts::Permanent)
        | State::Up
        | State::Down
        | State::Suspending
        | State::Suspended
        | State::Resuming
        | State::Quarantined { .. } => false,
    }
}

/// Boots the VM while what its create made is made durable: the VMM
/// reads its root disk and seed from the page cache, so it need not
/// wait for them to reach the disk, and the create is recorded done
/// only once both have (a power cut before that finds the record
/// still creating, and the next attempt makes both again). A sync
/// that fails stops the VMM it was for: its VM's disk cannot be
/// trusted to survive the host.
fn boot_syncing(
    ctx: &Context,
    spec: &crate::model::VmSpec,
    made: Pending,
    deadline: Deadline,
    narrator: &Narrator,
) -> Outcome {
    narrator.say("booting");
    let booting = std::time::Instant::now();
    start_syncing(ctx, &spec.vm_id, made, deadline, || {
        timed("boot", || ctx.backend.boot(spec, deadline))
    })?;
    ctx.counts.boots.observe(booting.elapsed());
    Ok(())
}

/// Starts the VM's hypervisor (`start`) while what its create made is
/// synced; a sync that fails stops it (see [`boot_syncing`]).
fn start_syncing(
    ctx: &Context,
    vm_id: &Id,
    made: Pending,
    deadline: Deadline,
    start: impl FnOnce() -> Outcome + Send,
) -> Outcome {
    let (synced, started) = crate::threads::alongside(
        &format!("sync-{vm_id}"),
        || timed("sync made", || sync_made(vm_id, made)),
        start,
    );
    started?;
    let synced = synced
        .map_err(|why| panicked("syncing the root disk and seed", why))
        .and_then(|synced| synced);
    if let Err(e) = synced {
        let say = |_: &str| {};
        if let Err(stop) = ctx.backend.shutdown(vm_id, deadline, &say) {
            log::error!(
                "VM {vm_id}: cannot stop the hypervisor after its disk failed to sync: {}",
                chain(&*stop)
            );
        }
        return Err(e);
    }
    Ok(())
}

/// Makes what a create made durable (see [`Pending`]).
fn sync_made(vm_id: &Id, made: Pending) -> Outcome {
    made.sync().map_err(|e| {
        Simple::transient(format!(
            "VM {vm_id}: cannot make its root disk and seed durable: {e}"
        ))
        .into()
    })
}

/// What a counted attempt has in place but not yet durable: the
/// record's name ([`Store::save_visible`]) and the names of the host's
/// share the backend took beside it ([`Lifecycle::reserve`]), synced
/// together beside the root disk's making, before the VMM starts.
///
/// [`Store::save_visible`]: crate::state::Store::save_visible
/// [`Lifecycle::reserve`]: crate::provision::Lifecycle::reserve
struct NotYetDurable {
    unsynced: Unsynced,
    reserved: Pending,
}

/// How the host-key stage ends: go on (with the key, when the VM
/// presents a certificate), or wait for the certificate.
enum HostKeyStage {
    Go(Option<HostKey>),
    AwaitingCertificate,
}

/// The record a create starts from: the last one, its spec moved on to the
/// desired one (its budget starts over), or a new one; the egress is the
/// desired one's.
fn wanted_record(d: &DesiredVm, prior: Option<&Record>) -> Record {
    let mut rec = prior
        .cloned()
        .unwrap_or_else(|| Record::new(d.spec.clone()));
    if prior.is_some() && rec.spec != d.spec {
        rec.spec_changed(d.spec.clone());
    }
    rec.egress.clone_from(&d.egress);
    rec
}

/// What the seed tells the guest. It learns its address from the host
/// network by DHCP; no address is baked into the seed.
fn seed_params(d: &DesiredVm, host_key: Option<HostKey>) -> SeedParams {
    let vm_id = &d.spec.vm_id;
    SeedParams {
        hostname: d.spec.name.clone(),
        instance_id: vm_id.to_string(),
        ssh_authorized_key: d.spec.ssh_authorized_key.clone(),
        user_data: d.spec.cloud_init.clone(),
        ssh_user_ca_keys: ca_lines(&d.ssh_user_ca_keys),
        ssh_host_key_public: host_key
            .as_ref()
            .map(|k| k.public_line.clone())
            .unwrap_or_default(),
        ssh_host_key_pem: host_key.map(|k| k.private_pem).unwrap_or_default(),
        ssh_host_cert: d.ssh_host_cert.clone(),
        mac: Mac::underlay(vm_id).to_string(),
        network_mac: if d.spec.network.is_empty() {
            String::new()
        } else {
            Mac::second_nic(vm_id).to_string()
        },
    }
}

/// How much more room a full filesystem must have before a create that
/// met it full is tried again: more than the agent's own writes (its
/// report, its metrics) move it by from one tick to the next.
const ROOM_GROWN: u64 = 1 << 20;

/// How long a create that met a full filesystem waits, at most, before it
/// is tried again with no more room seen.
const ROOM_RECHECK: std::time::Duration = std::time::Duration::from_secs(60);

/// The budget bookkeeping of one create attempt.
struct Attempt<'a> {
    ctx: &'a Context,
    create: &'a Create,
    deadline: Deadline,
    /// Whether this pass counted an attempt; only a counted one is refunded.
    counted: bool,
    /// What the VM waited for before this pass, if it waited for the host.
    waited: Option<String>,
}

impl Attempt<'_> {
    /// The host, not the spec, must change: no attempt is spent (one this
    /// pass counted is given back), the row says what to fix, the host's
    /// status says it once for all the VMs that wait, and the next pass
    /// checks again. Saved only when the account changes, so a VM
    /// waiting for a fixed host costs no write per tick.
    fn wait_for_host(&self, rec: Record, error: String, res: &mut VmResult) -> Next {
        self.wait(rec, error, String::new(), None, res)
    }

    /// A full filesystem (or a spent quota) met on the way: the host must
    /// make room, as for any host condition. The row adds how much room
    /// the state dir's filesystem has left.
    fn wait_for_room(&self, rec: Record, error: String, res: &mut VmResult) -> Next {
        let ctx = self.ctx;
        let room = crate::state::Room::at(ctx.store.root());
        let said = room
            .as_ref()
            .map(|room| format!("; {room}: make room there, and it is created again by itself"))
            .unwrap_or_default();
        let full = room.map(|room| (room.free, ctx.host.now()));
        self.wait(rec, error, said, full, res)
    }

    /// `error` is what failed, `said` what the row adds to it (the free
    /// room, which changes as the host writes): a VM still waiting on the
    /// same failure is not logged again, and its record is saved again
    /// only to take back the attempt this pass saved.
    fn wait(
        &self,
        mut rec: Record,
        error: String,
        said: String,
        full: Option<(u64, std::time::SystemTime)>,
        res: &mut VmResult,
    ) -> Next {
        let ctx = self.ctx;
        let unchanged = self
            .waited
            .as_deref()
            .is_some_and(|waited| waited.starts_with(&error));
        let error = error + &said;
        self.create.waiting.lock().insert(
            rec.spec.vm_id.clone(),
            Waiting {
                said: error.clone(),
                full,
            },
        );
        rec.host_not_ready(error, self.counted);
        if !unchanged {
            ctx.counts.create_failures.inc("host");
            ctx.log_failure(
                &rec.spec.vm_id,
                "cannot create it until the host is fixed",
                rec.lifecycle.last_error(),
            );
        }
        if !unchanged || self.counted {
            ctx.save_best_effort(&rec);
        }
        ctx.report_recorded(res, &rec, PowerState::Stopped);
        Next::Done
    }

    fn fail(&self, mut rec: Record, err: BoxFailure, res: &mut VmResult) -> Next {
        let ctx = self.ctx;
        let budget = ctx.budget();
        let permanent = err.is_permanent();
        if !self.deadline.expired() {
            if err.is_host_condition() {
                return self.wait_for_host(rec, chain(&*err), res);
            }
            if crate::error::out_of_space(&*err) {
                return self.wait_for_room(rec, chain(&*err), res);
            }
        }
        self.create.forget(&rec.spec.vm_id);
        let err: &dyn std::error::Error = &*err;
        let error = chain(err);
        let counts = &ctx.counts;
        match (self.deadline.expired(), self.counted, permanent) {
            (true, true, _) => {
                counts.refunds.inc();
                rec.refund_attempt(error);
            }
            (true, false, _) | (false, false, false) => {
                counts.create_failures.inc("transient");
                rec.could_not_attempt(error);
            }
            (false, _, permanent) => {
                counts
                    .create_failures
                    .inc(if permanent { "permanent" } else { "transient" });
                rec.attempt_failed(error, permanent, ctx.host.now());
            }
        }
        let said = if rec.lifecycle.failure_permanent() {
            "create failed, and no retry can succeed with this spec".to_owned()
        } else {
            format!(
                "create failed ({} of {} attempts spent)",
                rec.lifecycle.create_attempts(),
                budget.max_attempts
            )
        };
        ctx.log_failure(&rec.spec.vm_id, &said, rec.lifecycle.last_error());
        ctx.save_best_effort(&rec);
        ctx.report_recorded(res, &rec, PowerState::Stopped);
        Next::Done
    }
}

/// How far an image download has come, in the unit it reads best in: GiB
/// from 1 GiB up, MiB below (an image is never smaller than a MiB, and
/// kilobytes would look like a stall).
pub(crate) fn download_detail(done: u64, total: Option<u64>) -> String {
    const MIB: f64 = (1u64 << 20) as f64;
    const GIB: f64 = (1u64 << 30) as f64;
    let (scale, unit) = if done.max(total.unwrap_or(0)) >= 1 << 30 {
        (GIB, "GiB")
    } else {
        (MIB, "MiB")
    };
    let done = done as f64 / scale;
    match total {
        Some(total) if total > 0 => {
            format!(
                "downloading image {done:.1}/{:.1} {unit}",
                total as f64 / scale
            )
        }
        _ => format!("downloading image {done:.1} {unit}"),
    }
}

/// The tenant user-CA keys as the content of the guest's TrustedUserCAKeys
/// file: one key per line, each newline-terminated; empty for none.
fn ca_lines(keys: &[String]) -> String {
    keys.iter().map(|k| format!("{k}\n")).collect()
}

/// What an attempt's side effects came to.
struct Built {
    /// Its guest runs: booted, or a clone restored.
    boots: bool,
    /// What its guest agent said of its guest on the way (a clone's
    /// identity carries its status), for its row's readiness in this pass.
    guest_said: Option<crate::guest::Status>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detail_in_gib_with_total() {
        let gib = 1u64 << 30;

        let detail = download_detail(gib + gib / 5, Some(2 * gib));

        assert_eq!(detail, "downloading image 1.2/2.0 GiB");
    }

    #[test]
    fn detail_in_mib_below_a_gib() {
        let mib = 1u64 << 20;

        let detail = download_detail(300 * mib, Some(512 * mib));

        assert_eq!(detail, "downloading image 300.0/512.0 MiB");
    }

    #[test]
    fn detail_without_a_total() {
        let detail = download_detail(5 << 20, None);

        assert_eq!(detail, "downloading image 5.0 MiB");
    }

    #[test]
    fn ca_lines_are_newline_terminated() {
        assert_eq!(ca_lines(&["a".into(), "b".into()]), "a\nb\n");
        assert_eq!(ca_lines(&[]), "");
    }
}
