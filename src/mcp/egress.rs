//! Where custody's MCP client may connect: only `http`/`https` URLs, and (by default) never a
//! link-local or cloud-metadata address.
//!
//! An MCPServer's `spec.url` is written by a namespace tenant, and custody connects to it from
//! the controller's (or the sweep's) network position with headers the tenant chose, so an
//! unchecked URL is a server-side request forgery: `http://169.254.169.254/` reaches the node's
//! cloud-metadata endpoint, which hands out the node's credentials. The check runs where the
//! address is final:
//! - the URL's host, before connecting: an IP literal never reaches a resolver (hyper-util's
//!   connector skips DNS for it), and the metadata host names are refused by name;
//! - every address a name resolves to, inside reqwest's connector ([`GuardedResolver`], set with
//!   `ClientBuilder::dns_resolver`), so the address checked is the address connected to: a name
//!   that resolves to 169.254.169.254, on the first lookup or on a later one (DNS rebinding), is
//!   refused;
//! - redirects are not followed at all ([`redirect_policy`]): a redirect target would skip the
//!   host check, and reqwest's default policy follows any origin, replaying custom headers
//!   (`X-Api-Key`, not only `Authorization`) to the new host.
//!
//! Loopback and private (RFC 1918, ULA) addresses are allowed: in-cluster MCP servers are
//! Services on private ClusterIPs, and local mode runs them on loopback. Refusing those belongs to
//! a NetworkPolicy, which also covers the database connections this check does not see.
//!
//! With an HTTP(S) proxy configured (`HTTPS_PROXY`, `HTTP_PROXY`, `ALL_PROXY`, honoured by
//! reqwest) the connection goes to the proxy, which resolves the target's name itself, so the
//! resolver check sees only the proxy's address. The target is then checked before connecting
//! ([`check_target`]): by literal and by name as always, and its name must resolve here to
//! allowed addresses (a name that does not resolve here is refused, where without a proxy it
//! would just fail to connect). Not covered: the proxy's own lookup answering differently (split
//! DNS, rebinding between custody's lookup and the proxy's); the proxy must enforce the rule for
//! that (SECURITY.md).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::OnceLock;

use reqwest::dns::{Addrs, Name, Resolve, Resolving};

/// Which addresses the MCP client refuses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AddressPolicy {
    /// Refuse link-local and cloud-metadata addresses (see [`refused_ip`] and
    /// [`refused_host`]). The default.
    #[default]
    DenyMetadata,
    /// Connect wherever the URL points (for a deployment whose MCP server really is link-local).
    AllowAll,
}

/// `--deny-metadata-addresses`, shared by `custody controller`, `custody sweep` and
/// `custody discover`.
#[derive(Clone, Copy, Debug, clap::Args)]
pub struct EgressOptions {
    /// Refuse MCP server URLs whose host is, or resolves to, a link-local or cloud-metadata
    /// address (169.254.0.0/16 incl. 169.254.169.254, fe80::/10, fd00:ec2::254,
    /// 100.100.100.200, metadata.google.internal), checked at every connection after DNS
    /// resolution. `false` allows them.
    #[arg(
        long,
        env = "CUSTODY_DENY_METADATA_ADDRESSES",
        default_value_t = true,
        action = clap::ArgAction::Set,
        value_name = "BOOL"
    )]
    pub deny_metadata_addresses: bool,
}

impl EgressOptions {
    /// The policy these options select.
    pub fn policy(self) -> AddressPolicy {
        if self.deny_metadata_addresses {
            AddressPolicy::DenyMetadata
        } else {
            AddressPolicy::AllowAll
        }
    }
}

/// The process's policy. It is a property of where the process runs (next to a metadata
/// endpoint or not), not of a server, so it is set once at startup rather than carried by every
/// [`super::ServerConfig`].
static POLICY: OnceLock<AddressPolicy> = OnceLock::new();

/// Sets the process's policy; the first call wins (later calls are ignored). Without a call the
/// policy is [`AddressPolicy::DenyMetadata`].
pub fn set_policy(policy: AddressPolicy) {
    let _ = POLICY.set(policy);
}

/// The process's policy.
pub fn policy() -> AddressPolicy {
    POLICY.get().copied().unwrap_or_default()
}

/// Host names of cloud-metadata services (GCP; the others are reached by address).
const METADATA_HOSTS: &[&str] = &["metadata.google.internal", "metadata.goog"];

/// Why an address is refused under [`AddressPolicy::DenyMetadata`], or `None` when it is allowed.
///
/// Refused: 169.254.0.0/16 (IPv4 link-local, RFC 3927; AWS, Azure, GCP, OCI and OpenStack serve
/// metadata at 169.254.169.254), fe80::/10 (IPv6 link-local, RFC 4291), fd00:ec2::254 (AWS's IPv6
/// metadata endpoint), 100.100.100.200 (Alibaba Cloud's metadata endpoint), and each of those
/// inside an IPv4-mapped (`::ffff:0:0/96`) or NAT64 (`64:ff9b::/96`, RFC 6052) IPv6 address.
pub fn refused_ip(ip: IpAddr) -> Option<&'static str> {
    match ip {
        IpAddr::V4(v4) => refused_v4(v4),
        IpAddr::V6(v6) => {
            if let Some(v4) = v6.to_ipv4_mapped().or_else(|| nat64(v6)) {
                return refused_v4(v4);
            }
            if v6 == Ipv6Addr::new(0xfd00, 0xec2, 0, 0, 0, 0, 0, 0x254) {
                Some("the AWS IPv6 metadata endpoint")
            } else if v6.segments()[0] & 0xffc0 == 0xfe80 {
                Some("link-local (fe80::/10)")
            } else {
                None
            }
        }
    }
}

fn refused_v4(v4: Ipv4Addr) -> Option<&'static str> {
    if v4.is_link_local() {
        Some("link-local (169.254.0.0/16, where clouds serve instance metadata)")
    } else if v4 == Ipv4Addr::new(100, 100, 100, 200) {
        Some("the Alibaba Cloud metadata endpoint")
    } else {
        None
    }
}

/// The IPv4 address embedded in a NAT64 well-known-prefix address (`64:ff9b::a.b.c.d`).
fn nat64(v6: Ipv6Addr) -> Option<Ipv4Addr> {
    let s = v6.segments();
    (s[..6] == [0x64, 0xff9b, 0, 0, 0, 0]).then(|| {
        let [a, b] = s[6].to_be_bytes();
        let [c, d] = s[7].to_be_bytes();
        Ipv4Addr::new(a, b, c, d)
    })
}

/// Why a URL host is refused before any connection, or `None`: an IP literal checked by
/// [`refused_ip`], or a cloud-metadata host name (case-insensitive, with or without the
/// trailing dot).
pub fn refused_host(host: &url::Host<&str>) -> Option<String> {
    let reason = match host {
        url::Host::Ipv4(v4) => refused_ip(IpAddr::V4(*v4))?,
        url::Host::Ipv6(v6) => refused_ip(IpAddr::V6(*v6))?,
        url::Host::Domain(name) => {
            let name = name.trim_end_matches('.').to_ascii_lowercase();
            if !METADATA_HOSTS.contains(&name.as_str()) {
                return None;
            }
            "a cloud-metadata host name"
        }
    };
    Some(format!("{host} is {reason}"))
}

/// Checks a server URL before connecting: `http` or `https` (the API server's CEL rule says the
/// same, but local mode and anything that bypasses admission reach here too), a host, and under
/// `policy` not a refused host.
///
/// # Errors
/// A sentence naming the URL's problem, without the URL's userinfo or query.
pub fn check_url(url: &str, policy: AddressPolicy) -> Result<(), String> {
    let parsed = url::Url::parse(url).map_err(|e| format!("url is not a URL: {e}"))?;
    if !matches!(parsed.scheme(), "http" | "https") {
        return Err(format!(
            "url scheme {:?} is not allowed; only http and https",
            parsed.scheme()
        ));
    }
    let host = parsed.host().ok_or("url has no host")?;
    if policy == AddressPolicy::DenyMetadata
        && let Some(reason) = refused_host(&host)
    {
        return Err(format!("url refused: {reason} (--deny-metadata-addresses)"));
    }
    Ok(())
}

/// [`check_url`], then, for a host name under [`AddressPolicy::DenyMetadata`], the addresses it
/// resolves to now. This lookup only makes the error readable (rmcp's connect error drops the
/// resolver's reason); what enforces the rule is [`GuardedResolver`] inside the connection, which
/// also refuses an answer that changed since (DNS rebinding). A name that does not resolve passes
/// here and fails in the connection with the usual error.
///
/// # Errors
/// As [`check_url`], or [`RefusedAddress`]'s sentence.
pub async fn check_target(url: &str, policy: AddressPolicy) -> Result<(), String> {
    check_url(url, policy)?;
    let parsed = url::Url::parse(url).map_err(|e| e.to_string())?;
    if let (AddressPolicy::DenyMetadata, Some(url::Host::Domain(name))) = (policy, parsed.host()) {
        match tokio::net::lookup_host((name, 0)).await {
            Ok(addrs) => {
                screen(name, addrs.collect()).map_err(|e| e.to_string())?;
            }
            Err(e) => {
                if let Some(var) = proxy_variable() {
                    return Err(format!(
                        "url refused: {name} does not resolve here ({e}), and with {var} set the \
                         proxy would resolve it, so custody cannot check that it is not a \
                         metadata address (--deny-metadata-addresses); make the name resolvable \
                         where custody runs"
                    ));
                }
            }
        }
    }
    Ok(())
}

/// The proxy variables reqwest honours (upper and lower case, as it reads them).
const PROXY_VARIABLES: [&str; 6] = [
    "HTTPS_PROXY",
    "https_proxy",
    "HTTP_PROXY",
    "http_proxy",
    "ALL_PROXY",
    "all_proxy",
];

/// The first proxy variable set (non-empty) in the environment, when any is. Checked without
/// `NO_PROXY` and the URL's scheme on purpose: a name exempted by them connects directly, where
/// the stricter rule costs nothing (a name that does not resolve cannot be connected to anyway).
fn proxy_variable() -> Option<&'static str> {
    PROXY_VARIABLES
        .into_iter()
        .find(|v| std::env::var_os(v).is_some_and(|value| !value.is_empty()))
}

/// reqwest's resolver, refusing a name when any address it resolves to is refused by
/// [`refused_ip`]. Resolution is the system's (`getaddrinfo` on a blocking thread, as reqwest's
/// default resolver does), so `/etc/hosts`, search domains and cluster DNS behave as before.
#[derive(Clone, Copy, Debug, Default)]
pub struct GuardedResolver;

/// A name that resolved to a refused address.
#[derive(Debug, thiserror::Error)]
#[error("{name} resolves to {addr}, which is {reason} (--deny-metadata-addresses)")]
pub struct RefusedAddress {
    /// The host name.
    pub name: String,
    /// The refused address.
    pub addr: IpAddr,
    /// Why it is refused.
    pub reason: &'static str,
}

/// Refuses the whole answer when one address is refused: connecting to the other addresses
/// would make the outcome depend on the order reqwest tries them in.
///
/// # Errors
/// [`RefusedAddress`] for the first refused address.
pub fn screen(name: &str, addrs: Vec<SocketAddr>) -> Result<Vec<SocketAddr>, RefusedAddress> {
    if let Some((addr, reason)) = addrs
        .iter()
        .find_map(|a| refused_ip(a.ip()).map(|r| (a.ip(), r)))
    {
        return Err(RefusedAddress {
            name: name.to_owned(),
            addr,
            reason,
        });
    }
    Ok(addrs)
}

/// A name the system resolver could not resolve, typed so that [`super::cause::describe`] can
/// say so (hyper's own wrapper only says "dns error").
#[derive(Debug, thiserror::Error)]
#[error("{name} does not resolve: {source}")]
pub struct Unresolved {
    /// The host name.
    pub name: String,
    /// The resolver's error (`failed to lookup address information: …`).
    pub source: std::io::Error,
}

impl Resolve for GuardedResolver {
    fn resolve(&self, name: Name) -> Resolving {
        let name = name.as_str().to_owned();
        Box::pin(async move {
            // Port 0: reqwest puts the URL's port on every address it is given.
            let addrs: Vec<SocketAddr> = tokio::net::lookup_host((name.as_str(), 0))
                .await
                .map_err(|source| Unresolved {
                    name: name.clone(),
                    source,
                })?
                .collect();
            let addrs = screen(&name, addrs)?;
            Ok(Box::new(addrs.into_iter()) as Addrs)
        })
    }
}

/// The redirect policy of custody's HTTP client: never follow. A redirect target would bypass
/// [`check_url`] and receive the server's headers; an MCP endpoint that moved is configured
/// anew. The 3xx answer reaches rmcp, which reports it as an HTTP error.
pub fn redirect_policy() -> reqwest::redirect::Policy {
    reqwest::redirect::Policy::none()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn metadata_and_link_local_addresses_are_refused() {
        for refused in [
            "169.254.169.254",
            "169.254.0.1",
            "169.254.255.255",
            "100.100.100.200",
            "fe80::1",
            "febf::1",
            "fd00:ec2::254",
            "::ffff:169.254.169.254",
            "64:ff9b::a9fe:a9fe",
        ] {
            assert!(refused_ip(ip(refused)).is_some(), "{refused}");
        }
        for allowed in [
            "127.0.0.1",
            "10.0.0.7",
            "192.168.1.1",
            "172.16.0.1",
            "169.253.255.255",
            "169.255.0.0",
            "8.8.8.8",
            "::1",
            "fd00:ec2::253",
            "fec0::1",
            "::ffff:10.1.2.3",
        ] {
            assert_eq!(refused_ip(ip(allowed)), None, "{allowed}");
        }
    }

    #[test]
    fn urls_are_checked_by_scheme_and_host() {
        let deny = AddressPolicy::DenyMetadata;
        assert!(check_url("http://127.0.0.1:8080/mcp", deny).is_ok());
        assert!(check_url("https://basket.agents.svc/mcp", deny).is_ok());
        for (url, says) in [
            ("ftp://example.com/mcp", "scheme \"ftp\" is not allowed"),
            ("file:///etc/passwd", "scheme \"file\" is not allowed"),
            (
                "http://169.254.169.254/latest",
                "169.254.169.254 is link-local",
            ),
            ("http://[fd00:ec2::254]/", "AWS IPv6 metadata endpoint"),
            ("http://[::ffff:169.254.169.254]/", "link-local"),
            (
                "http://Metadata.Google.Internal./",
                "cloud-metadata host name",
            ),
            (
                "http://metadata.google.internal/computeMetadata/v1/",
                "cloud-metadata host name",
            ),
        ] {
            let e = check_url(url, deny).unwrap_err();
            assert!(e.contains(says), "{url}: {e}");
        }
        assert!(check_url("http://169.254.169.254/", AddressPolicy::AllowAll).is_ok());
        assert!(check_url("ftp://x/", AddressPolicy::AllowAll).is_err());
    }

    #[test]
    fn one_refused_address_refuses_the_name() {
        let a = |s: &str| SocketAddr::new(ip(s), 0);
        let e = screen("rebind.example", vec![a("10.0.0.1"), a("169.254.169.254")]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "rebind.example resolves to 169.254.169.254, which is link-local (169.254.0.0/16, \
             where clouds serve instance metadata) (--deny-metadata-addresses)"
        );
        assert_eq!(screen("ok", vec![a("10.0.0.1")]).unwrap().len(), 1);
    }

    #[tokio::test]
    async fn the_resolver_screens_what_the_system_resolves() {
        let addrs: Vec<SocketAddr> = GuardedResolver
            .resolve("localhost".parse().unwrap())
            .await
            .unwrap()
            .collect();
        assert!(addrs.iter().all(|a| a.ip().is_loopback()), "{addrs:?}");
    }
}
