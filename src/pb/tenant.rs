//! The wire's promises to a tenant's VM, checked: its own egress ranges,
//! its published ports, its limits and its readiness probe (see the
//! README's Limits, Published ports and Readiness). Each bad value refuses its VM entry alone, naming the field.

use std::time::Duration;

use crate::model::{
    Check, Cidr, Limits, Publish, Readiness, Sleep, SpecError, Transport, VmLimits,
};
use crate::pb;
use crate::quote;

/// One of a VM's egress lists: IPv4 ranges, at most
/// [`Limits::MAX_EGRESS_RULES`], each once.
pub(super) fn egress_list(field: &'static str, raw: &[String]) -> Result<Vec<Cidr>, SpecError> {
    if raw.len() > Limits::MAX_EGRESS_RULES {
        return Err(SpecError::new(
            field,
            format!("{} ranges, at most {}", raw.len(), Limits::MAX_EGRESS_RULES),
        ));
    }
    let mut list = Vec::with_capacity(raw.len());
    let mut seen = std::collections::HashSet::with_capacity(raw.len());
    for text in raw {
        let cidr = Cidr::parse(text).map_err(|e| {
            SpecError::new(
                field,
                format!(
                    "{}: {e}; write an IPv4 range as a.b.c.d/n",
                    quote::text(text)
                ),
            )
        })?;
        if !seen.insert(cidr) {
            return Err(SpecError::new(field, format!("{cidr} is listed twice")));
        }
        list.push(cidr);
    }
    Ok(list)
}

/// A VM's published ports: at most [`Limits::MAX_PUBLISHED_PORTS`], each
/// port of the host once. Whether the host's range holds them is the
/// host's to say (`--publish-ports`), when it holds them.
pub(super) fn published_ports(raw: &[pb::PublishedPort]) -> Result<Vec<Publish>, SpecError> {
    const FIELD: &str = "published_ports";
    if raw.len() > Limits::MAX_PUBLISHED_PORTS {
        return Err(SpecError::new(
            FIELD,
            format!(
                "{} ports, at most {}",
                raw.len(),
                Limits::MAX_PUBLISHED_PORTS
            ),
        ));
    }
    let mut list: Vec<Publish> = Vec::with_capacity(raw.len());
    for p in raw {
        let transport = Transport::parse(&p.protocol).ok_or_else(|| {
            SpecError::new(
                FIELD,
                format!(
                    "protocol {} is not \"tcp\" or \"udp\"",
                    quote::text(&p.protocol)
                ),
            )
        })?;
        let port = |what: &str, n: u32| {
            u16::try_from(n)
                .ok()
                .filter(|n| *n > 0)
                .ok_or_else(|| SpecError::new(FIELD, format!("{what} {n} is not a port (1-65535)")))
        };
        let host_address = match p.host_address.as_str() {
            "" => None,
            text => {
                let address: std::net::Ipv4Addr = text.parse().map_err(|_| {
                    SpecError::new(
                        FIELD,
                        format!(
                            "host_address {} is not an IPv4 address (or empty, for every address of the host)",
                            quote::text(text)
                        ),
                    )
                })?;
                if let Some(why) = crate::model::unpublishable(address) {
                    return Err(SpecError::new(
                        FIELD,
                        format!("host_address {address}: {why}"),
                    ));
                }
                Some(address)
            }
        };
        let publish = Publish {
            transport,
            host_port: port("host_port", p.host_port)?,
            guest_port: port("guest_port", p.guest_port)?,
            host_address,
        };
        let side = publish.host_side();
        if let Some(other) = list.iter().find(|o| o.host_side().overlaps(&side)) {
            return Err(SpecError::new(
                FIELD,
                format!("{side} is published twice ({other} and {publish})"),
            ));
        }
        list.push(publish);
    }
    Ok(list)
}

/// What is done when the guest's kernel panics: `stay` (or empty) or
/// `reboot`.
pub(super) fn on_panic(raw: &str) -> Result<crate::model::OnPanic, SpecError> {
    use crate::model::OnPanic;
    match raw {
        "" | "stay" => Ok(OnPanic::Stay),
        "reboot" => Ok(OnPanic::Reboot),
        other => Err(SpecError::new(
            "on_panic",
            format!(
                "{} is neither \"stay\" nor \"reboot\"",
                crate::quote::text(other)
            ),
        )),
    }
}

/// When a VM sleeps and what wakes it. An idle time needs wake on
/// traffic: a VM suspended for idleness while wanted running would
/// otherwise be resumed by the next pass, and suspended again.
pub(super) fn sleep(wake_on_traffic: bool, idle_suspend_after_s: u32) -> Result<Sleep, SpecError> {
    const FIELD: &str = "idle_suspend_after_s";
    let idle_after = match idle_suspend_after_s {
        0 => None,
        _ if !wake_on_traffic => {
            return Err(SpecError::new(
                FIELD,
                "needs wake_on_traffic: a VM suspended for idleness wakes only on traffic; set both, or neither",
            ));
        }
        s if u64::from(s) > Sleep::MAX_IDLE.as_secs() => {
            return Err(SpecError::new(
                FIELD,
                format!("{s} s, at most {} (30 days)", Sleep::MAX_IDLE.as_secs()),
            ));
        }
        s => Some(Duration::from_secs(u64::from(s))),
    };
    Ok(Sleep {
        wake_on_traffic,
        idle_after,
    })
}

/// The wire's form of published ports.
pub(super) fn published_to_wire(list: &[Publish]) -> Vec<pb::PublishedPort> {
    list.iter()
        .map(|p| pb::PublishedPort {
            protocol: p.transport.as_str().to_owned(),
            host_port: u32::from(p.host_port),
            guest_port: u32::from(p.guest_port),
            host_address: p.host_address.map(|a| a.to_string()).unwrap_or_default(),
        })
        .collect()
}

/// A VM's limits: each 0 (the host's) or within its bounds.
pub(super) fn vm_limits(raw: &pb::VmSpec, vcpus: u32) -> Result<VmLimits, SpecError> {
    let cpu_cap = u64::from(vcpus) * 1000;
    let cpu_max_millis = zero_or_within(
        "cpu_max_millis",
        raw.cpu_max_millis,
        Limits::MIN_CPU_MAX_MILLIS,
        cpu_cap,
    )
    .map_err(|e| {
        e.hint(&format!(
            "a cap is thousandths of a CPU, at most 1000 per vCPU ({vcpus} here)"
        ))
    })?;
    // The kernel refuses a burst larger than the quota of one period.
    let burst_cap = if cpu_max_millis == 0 {
        cpu_cap / 10
    } else {
        cpu_max_millis / 10
    };
    let cpu_burst_ms =
        zero_or_within("cpu_burst_ms", raw.cpu_burst_ms, 1, burst_cap).map_err(|e| {
            e.hint("a burst is at most the cap's quota of one 100 ms period (cpu_max_millis / 10)")
        })?;
    Ok(VmLimits {
        cpu_max_millis: cpu_max_millis as u32,
        cpu_burst_ms: cpu_burst_ms as u32,
        disk_mbps: zero_or_within("disk_mbps", raw.disk_mbps, 1, Limits::MAX_DISK_MBPS)? as u32,
        disk_iops: zero_or_within("disk_iops", raw.disk_iops, 1, Limits::MAX_DISK_IOPS)? as u32,
        net_mbps: zero_or_within("net_mbps", raw.net_mbps, 1, Limits::MAX_NET_MBPS)? as u32,
    })
}

/// 0 (the host's default), or a value in `min..=max`.
fn zero_or_within(field: &'static str, value: i64, min: u64, max: u64) -> Result<u64, SpecError> {
    match u64::try_from(value) {
        Ok(0) => Ok(0),
        Ok(v) if (min..=max).contains(&v) => Ok(v),
        _ => Err(SpecError::new(
            field,
            format!("{value} is neither 0 (the host's default) nor in {min}..={max}"),
        )),
    }
}

/// A readiness probe: one check, its timing within bounds, zeros the
/// defaults.
pub(super) fn readiness(raw: &pb::Readiness) -> Result<Readiness, SpecError> {
    let field = "readiness";
    if !raw.http_path.is_empty() && raw.tcp_port == 0 {
        return Err(SpecError::new(
            field,
            "http_path needs tcp_port, the port to GET it on",
        ));
    }
    let check = match (raw.serial_contains.is_empty(), raw.tcp_port) {
        (false, 0) => {
            let text = &raw.serial_contains;
            if text.len() > 256 || text.chars().any(char::is_control) {
                return Err(SpecError::new(
                    field,
                    format!(
                        "serial_contains {} is not 1-256 printable bytes",
                        quote::text(text)
                    ),
                ));
            }
            Check::Serial(text.clone())
        }
        (true, port) if (1..=65535).contains(&port) && raw.http_path.is_empty() => {
            Check::Tcp(port as u16)
        }
        (true, port) if (1..=65535).contains(&port) => {
            let path = &raw.http_path;
            if !path.starts_with('/')
                || path.len() > 1024
                || !path.bytes().all(|b| b.is_ascii_graphic())
            {
                return Err(SpecError::new(
                    field,
                    format!(
                        "http_path {} is not a path (\"/\" then up to 1 KiB of printable ASCII, no spaces)",
                        quote::text(path)
                    ),
                ));
            }
            Check::Http {
                port: port as u16,
                path: path.clone(),
            }
        }
        (true, 0) => {
            return Err(SpecError::new(
                field,
                "names no check: give serial_contains or tcp_port",
            ));
        }
        (true, port) => {
            return Err(SpecError::new(
                field,
                format!("tcp_port {port} is not a port (1..=65535)"),
            ));
        }
        (false, _) => {
            return Err(SpecError::new(
                field,
                "names two checks: give serial_contains or tcp_port, not both",
            ));
        }
    };
    let within = |what: &str, value: u32, default: u32, max: u32| match value {
        0 => Ok(default),
        v if v <= max => Ok(v),
        v => Err(SpecError::new(
            field,
            format!("{what} {v} is past {max} (0 = {default})"),
        )),
    };
    let period = within("period_s", raw.period_s, 2, 3600)?;
    let timeout = within(
        "timeout_ms",
        raw.timeout_ms,
        1000.min(period * 1000),
        period * 1000,
    )?;
    let grace = within("grace_s", raw.grace_s, 60, 86_400)?;
    let restart = within("restart_after_s", raw.restart_after_s, 0, 86_400)?;
    Ok(Readiness {
        check,
        period: Duration::from_secs(u64::from(period)),
        timeout: Duration::from_millis(u64::from(timeout)),
        grace: Duration::from_secs(u64::from(grace)),
        restart_after: (restart > 0).then(|| Duration::from_secs(u64::from(restart))),
    })
}

pub(super) fn readiness_to_wire(r: &Readiness) -> pb::Readiness {
    let (serial_contains, tcp_port, http_path) = match &r.check {
        Check::Serial(text) => (text.clone(), 0, String::new()),
        Check::Tcp(port) => (String::new(), u32::from(*port), String::new()),
        Check::Http { port, path } => (String::new(), u32::from(*port), path.clone()),
    };
    pb::Readiness {
        serial_contains,
        tcp_port,
        http_path,
        period_s: r.period.as_secs() as u32,
        timeout_ms: r.timeout.as_millis() as u32,
        grace_s: r.grace.as_secs() as u32,
        restart_after_s: r.restart_after.map_or(0, |d| d.as_secs() as u32),
    }
}
