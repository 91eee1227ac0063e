//! The fast way to read a review: a small scanner walks the body once, keeps the few
//! fields kvota uses as slices of the body, and steps over everything else. A created
//! pod's requests are counted as they are read: each quantity parsed by the core's
//! `parse_quantity_milli`, the pod's request of each resource combined by the core's
//! `container_request_milli` and `pod_request_milli` (the rules `effective_requests_milli`
//! uses), without the core's per-container maps. Reading into a `serde_json::Value` and
//! counting a `PodResources` (the reference path, [`super::read_value`]) costs several
//! times more: a map node and a `String` for every key and value of the whole pod, then
//! a map per container; even a typed serde deserializer spent most of a review's time in
//! serde_json's per-token work.
//!
//! [`read`] is strict where the reference path is lenient, and declines whatever it was
//! not written for: it returns `None` and the caller reads the body the reference way,
//! which words every error. It declines a field of a type it does not expect
//! (`"containers": null`, a container that is not an object, ...), a quantity that does
//! not parse, a request the reference would answer with an error, and the JSON it does
//! not handle itself: escapes in a string it reads, `\u` escapes in keys, numbers with
//! an exponent or more than [`MAX_DIGITS`] digits, nesting deeper than [`MAX_DEPTH`].
//! So [`read`] only ever answers when its answer is the reference path's. The unit tests
//! check this over the real AdmissionRequests in the fixtures and over random variations
//! of them (field edits, byte edits, random pods with init containers, sidecars,
//! overhead and bad quantities).
//!
//! What keeps the two in step:
//! - Every value is checked as serde_json checks it for a `Value` (the JSON grammar,
//!   whitespace, escapes, paired surrogates, control characters, trailing bytes), or the
//!   body is declined: a body the reference path rejects as not JSON is never accepted.
//!   Numbers that could overflow an `f64` (where serde_json fails) are declined.
//! - A key seen twice keeps its last value, as in a `Value` map.
//! - `null` is taken as a missing field exactly where the reference path's
//!   `.and_then(Value::as_str)` / `pointer` does the same; elsewhere it declines.
//! - serde_json gives a map whose key is one of its private tokens (`$serde_json::private::…`,
//!   used for raw values) a special meaning when building a `Value`; such a key (or a
//!   key written with `\u` escapes, which could spell one) is declined.

use kvota_fairness::resources::{container_request_milli, pod_request_milli};
use kvota_fairness::units::parse_quantity_milli;

use super::{pass, Create, ParsedKind, PodRequests};

/// Deepest nesting read; serde_json refuses 128 levels, this stays well inside.
const MAX_DEPTH: u32 = 100;
/// Most digits in a number read: below 10^300 no number overflows an `f64`.
const MAX_DIGITS: usize = 300;
/// The prefix of the keys serde_json treats specially when it builds a `Value`.
const SERDE_JSON_PRIVATE: &str = "$serde_json::private::";

/// Reads a review body (already checked for size) the fast way; `None` means "read it
/// the reference way" (see the module documentation).
pub(super) fn read(body: &[u8]) -> Option<ParsedKind> {
    // A body that is not UTF-8 is not JSON (the reference path says so); checked once,
    // whole, every slice taken below is a str.
    let body = std::str::from_utf8(body).ok()?;
    let mut scan = Scan {
        src: body,
        b: body.as_bytes(),
        i: 0,
        depth: 0,
    };
    let mut doc = Review::default();
    scan.object(|s, key| doc.field(s, key))?;
    scan.end()?;
    let (Some(api), Some(kind), Some(req)) = (doc.api_version, doc.kind, doc.request) else {
        return None;
    };
    if api != "admission.k8s.io/v1" || kind != "AdmissionReview" {
        return None;
    }
    let uid = req.uid.filter(|u| !u.is_empty())?;
    if let Some(passed) = not_a_pod(&req, uid) {
        return Some(passed);
    }
    // `object` absent, `null`, or an object; only the last has metadata.
    let object = req.object.as_ref().and_then(Option::as_ref);
    let meta = object.and_then(|o| o.metadata.as_ref());
    let namespace = req
        .namespace
        .or(meta.and_then(|m| m.namespace))
        .unwrap_or("")
        .to_string();
    let name = req
        .name
        .filter(|n| !n.is_empty())
        .or(meta.and_then(|m| m.name))
        .unwrap_or("")
        .to_string();
    let prefix = meta.and_then(|m| m.generate_name).unwrap_or("");
    let dry_run = req.dry_run.unwrap_or(false);
    match req.operation {
        Some("CREATE") => {}
        Some("DELETE") => return Some(ParsedKind::Delete { uid: uid.to_string() }),
        Some("UPDATE" | "CONNECT") => return Some(ParsedKind::Done(pass(uid, ""))),
        // An unknown or missing operation is an error: the reference path words it.
        _ => return None,
    }
    // A CREATE without an object, or whose object is null or has no spec, is an error.
    let spec = req.object?.and_then(|o| o.spec)?;
    let key = super::pod_key(&namespace, &name, prefix, uid);
    // A null spec is read as an empty pod, as the reference path reads it.
    let spec = spec.unwrap_or_default();
    let pod = PodRequests::Counted(Ok(spec.requests()));
    Some(ParsedKind::Create(Box::new(Create {
        uid: uid.to_string(),
        namespace,
        name,
        key,
        dry_run,
        pod,
        priority: spec.priority,
        has_gates: spec.has_gates,
    })))
}

/// The answer for a review of something other than a pod (another resource, or a
/// pod's subresource), which passes unjudged; `None` for a pod.
fn not_a_pod(req: &Request<'_>, uid: &str) -> Option<ParsedKind> {
    let (group, res) = req.resource.as_ref().map_or((None, None), |r| (r.group, r.resource));
    let (group, res) = (group.unwrap_or(""), res.unwrap_or(""));
    if res != "pods" || !group.is_empty() {
        return Some(ParsedKind::Done(pass(
            uid,
            &format!("kvota: {group}/{res} is not judged (only pods)"),
        )));
    }
    if req.sub_resource.is_some_and(|s| !s.is_empty()) {
        return Some(ParsedKind::Done(pass(uid, "kvota: pod subresources are not judged")));
    }
    None
}

/// The top of an AdmissionReview.
#[derive(Default)]
struct Review<'a> {
    api_version: Option<&'a str>,
    kind: Option<&'a str>,
    request: Option<Request<'a>>,
}

/// `request`: the AdmissionRequest.
#[derive(Default)]
struct Request<'a> {
    uid: Option<&'a str>,
    resource: Option<GroupResource<'a>>,
    sub_resource: Option<&'a str>,
    namespace: Option<&'a str>,
    name: Option<&'a str>,
    operation: Option<&'a str>,
    dry_run: Option<bool>,
    /// Absent (`None`), `null` (`Some(None)`), or the object.
    object: Option<Option<Object<'a>>>,
}

/// `request.resource`.
#[derive(Default)]
struct GroupResource<'a> {
    group: Option<&'a str>,
    resource: Option<&'a str>,
}

/// `request.object`: the pod.
#[derive(Default)]
struct Object<'a> {
    metadata: Option<Metadata<'a>>,
    /// Absent (`None`), `null` (`Some(None)`), or the spec.
    spec: Option<Option<Spec<'a>>>,
}

/// `request.object.metadata`.
#[derive(Default)]
struct Metadata<'a> {
    namespace: Option<&'a str>,
    name: Option<&'a str>,
    generate_name: Option<&'a str>,
}

/// `request.object.spec`: what the pod requests.
#[derive(Default)]
struct Spec<'a> {
    priority: i32,
    has_gates: bool,
    init_containers: Vec<Container>,
    containers: Vec<Container>,
    overhead: Quantities,
    /// Every quantity read, by resource name; containers and the overhead hold ranges
    /// of it (one allocation for the pod rather than one per map).
    quantities: Vec<(&'a str, u64)>,
}

impl Spec<'_> {
    /// The pod's request of every resource it names, sorted by name: what
    /// [`effective_requests_milli`](kvota_fairness::resources::effective_requests_milli)
    /// returns for the same pod (every quantity parsed already, none invalid), counted
    /// with the core's own rules ([`container_request_milli`], [`pod_request_milli`]) but
    /// without building its maps.
    fn requests(&self) -> Vec<(String, u64)> {
        let named = || {
            let all = self.init_containers.iter().chain(&self.containers);
            all.flat_map(|c| self.entries(&c.requests).iter().chain(self.entries(&c.limits)))
                .chain(self.entries(&self.overhead))
                .map(|&(name, _)| name)
        };
        let mut out: Vec<(String, u64)> = Vec::with_capacity(named().count());
        for name in named() {
            if out.iter().any(|(n, _)| n == name) {
                continue;
            }
            let milli = pod_request_milli(
                self.containers.iter().map(|c| self.request(c, name)),
                self.init_containers
                    .iter()
                    .map(|c| (c.restartable, self.request(c, name))),
                self.get(&self.overhead, name).unwrap_or(0),
            );
            out.push((name.to_owned(), milli));
        }
        out.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        out
    }

    fn entries(&self, q: &Quantities) -> &[(&str, u64)] {
        self.quantities.get(q.0.clone()).unwrap_or_default()
    }

    fn get(&self, q: &Quantities, resource: &str) -> Option<u64> {
        self.entries(q)
            .iter()
            .find(|&&(name, _)| name == resource)
            .map(|&(_, milli)| milli)
    }

    fn request(&self, c: &Container, resource: &str) -> u64 {
        container_request_milli(self.get(&c.requests, resource), self.get(&c.limits, resource))
    }
}

/// One entry of `spec.containers` or `spec.initContainers`: its requests and limits,
/// and whether it is a sidecar. (Its name only ever appears in an error, and errors come
/// from the reference path.)
#[derive(Default)]
struct Container {
    restartable: bool,
    requests: Quantities,
    limits: Quantities,
}

/// A map of resource name to quantity, each parsed to thousandths as the core parses it
/// ([`parse_quantity_milli`]), as a range of [`Spec::quantities`]; a key seen twice
/// keeps its last value.
#[derive(Default)]
struct Quantities(std::ops::Range<usize>);

// What each object keeps. A field's value is read with the type the reference path
// reads it as; any other type declines the body. Unknown keys are stepped over.

impl<'a> Review<'a> {
    fn field(&mut self, s: &mut Scan<'a>, key: &str) -> Option<()> {
        match key {
            "apiVersion" => self.api_version = s.str_or_null()?,
            "kind" => self.kind = s.str_or_null()?,
            // A request that is not an object is answered with an error.
            "request" => {
                let mut r = Request::default();
                s.object(|s, key| r.field(s, key))?;
                self.request = Some(r);
            }
            _ => s.skip()?,
        }
        Some(())
    }
}

impl<'a> Request<'a> {
    fn field(&mut self, s: &mut Scan<'a>, key: &str) -> Option<()> {
        match key {
            "uid" => self.uid = s.str_or_null()?,
            "resource" => {
                self.resource = if s.null()? {
                    None
                } else {
                    let mut r = GroupResource::default();
                    s.object(|s, key| r.field(s, key))?;
                    Some(r)
                };
            }
            "subResource" => self.sub_resource = s.str_or_null()?,
            "namespace" => self.namespace = s.str_or_null()?,
            "name" => self.name = s.str_or_null()?,
            "operation" => self.operation = s.str_or_null()?,
            "dryRun" => self.dry_run = s.bool_or_null()?,
            "object" => {
                self.object = Some(if s.null()? {
                    None
                } else {
                    let mut o = Object::default();
                    s.object(|s, key| o.field(s, key))?;
                    Some(o)
                });
            }
            _ => s.skip()?,
        }
        Some(())
    }
}

impl<'a> GroupResource<'a> {
    fn field(&mut self, s: &mut Scan<'a>, key: &str) -> Option<()> {
        match key {
            "group" => self.group = s.str_or_null()?,
            "resource" => self.resource = s.str_or_null()?,
            _ => s.skip()?,
        }
        Some(())
    }
}

impl<'a> Object<'a> {
    fn field(&mut self, s: &mut Scan<'a>, key: &str) -> Option<()> {
        match key {
            "metadata" => {
                self.metadata = if s.null()? {
                    None
                } else {
                    let mut m = Metadata::default();
                    s.object(|s, key| m.field(s, key))?;
                    Some(m)
                };
            }
            "spec" => {
                self.spec = Some(if s.null()? {
                    None
                } else {
                    // Room for a typical pod's quantities (a few containers, a few resources).
                    let mut p = Spec {
                        quantities: Vec::with_capacity(16),
                        ..Spec::default()
                    };
                    s.object(|s, key| p.field(s, key))?;
                    Some(p)
                });
            }
            _ => s.skip()?,
        }
        Some(())
    }
}

impl<'a> Metadata<'a> {
    fn field(&mut self, s: &mut Scan<'a>, key: &str) -> Option<()> {
        match key {
            "namespace" => self.namespace = s.str_or_null()?,
            "name" => self.name = s.str_or_null()?,
            "generateName" => self.generate_name = s.str_or_null()?,
            _ => s.skip()?,
        }
        Some(())
    }
}

impl<'a> Spec<'a> {
    fn field(&mut self, s: &mut Scan<'a>, key: &str) -> Option<()> {
        match key {
            "priority" => self.priority = s.priority()?,
            // A list (of anything) or null; other types decline.
            "schedulingGates" => {
                self.has_gates = !s.null()?;
                if self.has_gates {
                    s.array(Scan::skip)?;
                }
            }
            // Lists of objects; `null` or anything else declines.
            "initContainers" => self.init_containers = containers(s, &mut self.quantities)?,
            "containers" => self.containers = containers(s, &mut self.quantities)?,
            // An object of quantities; `null` declines.
            "overhead" => self.overhead = quantities(s, &mut self.quantities)?,
            _ => s.skip()?,
        }
        Some(())
    }
}

fn containers<'a>(s: &mut Scan<'a>, quantities: &mut Vec<(&'a str, u64)>) -> Option<Vec<Container>> {
    let mut out = Vec::new();
    s.array(|s| {
        let mut c = Container::default();
        s.object(|s, key| c.field(s, key, quantities))?;
        out.push(c);
        Some(())
    })?;
    Some(out)
}

impl Container {
    fn field<'a>(&mut self, s: &mut Scan<'a>, key: &str, arena: &mut Vec<(&'a str, u64)>) -> Option<()> {
        match key {
            "restartPolicy" => self.restartable = s.str_or_null()? == Some("Always"),
            // `null` resources hold nothing, as in the reference path.
            "resources" => {
                let (mut requests, mut limits) = (Quantities::default(), Quantities::default());
                if !s.null()? {
                    s.object(|s, key| match key {
                        // Objects of quantities; `null` declines.
                        "requests" => quantities(s, arena).map(|q| requests = q),
                        "limits" => quantities(s, arena).map(|q| limits = q),
                        _ => s.skip(),
                    })?;
                }
                (self.requests, self.limits) = (requests, limits);
            }
            _ => s.skip()?,
        }
        Some(())
    }
}

/// An object of quantities, appended to `arena`: strings, or JSON numbers read as the
/// reference path reads them (the text `serde_json::Number` writes back, e.g. `1000.0`
/// for `1000.0`).
fn quantities<'a>(s: &mut Scan<'a>, arena: &mut Vec<(&'a str, u64)>) -> Option<Quantities> {
    let start = arena.len();
    s.object_raw_keys(|s, key| {
        // Read keys only: one with escapes declines.
        let Key::Plain(name) = key else { return None };
        let milli = match s.peek()? {
            b'"' => parse_quantity_milli(s.str()?).ok()?,
            _ => {
                let number: serde_json::Number = serde_json::from_str(s.number()?).ok()?;
                parse_quantity_milli(&number.to_string()).ok()?
            }
        };
        match arena
            .get_mut(start..)
            .and_then(|own| own.iter_mut().find(|(n, _)| *n == name))
        {
            Some(entry) => entry.1 = milli,
            None => arena.push((name, milli)),
        }
        Some(())
    })?;
    Some(Quantities(start..arena.len()))
}

/// The length of the longest prefix of `b` without a byte JSON strings must escape: `"`,
/// `\` or a control character. Eight bytes at a time: most strings of a review have
/// none of those until their closing quote.
pub(super) fn plain_len(b: &[u8]) -> usize {
    const ONES: u64 = u64::from_ne_bytes([1; 8]);
    const HIGH: u64 = ONES << 7;
    // The high bit of each byte of `w` below `n` (n <= 0x80), and possibly of bytes
    // above such a byte (a borrow carries up), never of others: the lowest bit set marks
    // the first byte below `n`.
    let below = |w: u64, n: u8| w.wrapping_sub(ONES * u64::from(n)) & !w & HIGH;
    let mut i = 0;
    while let Some(Ok(chunk)) = b.get(i..i + 8).map(<[u8; 8]>::try_from) {
        let w = u64::from_le_bytes(chunk);
        let special = below(w, 0x20) | below(w ^ (ONES * u64::from(b'"')), 1) | below(w ^ (ONES * u64::from(b'\\')), 1);
        if special != 0 {
            // Little-endian: byte k holds bits 8k..8k+7.
            return i + usize::try_from(special.trailing_zeros() / 8).unwrap_or(0);
        }
        i += 8;
    }
    let rest = b.get(i..).unwrap_or_default();
    i + rest
        .iter()
        .position(|&c| c == b'"' || c == b'\\' || c < 0x20)
        .unwrap_or(rest.len())
}

/// A key as written: plain (borrowed as is), or with escapes (never one kvota reads).
enum Key<'a> {
    Plain(&'a str),
    Escaped,
}

/// A cursor over a body that is valid UTF-8. Every method returns `None` where the body
/// is not JSON or not JSON this reader handles.
struct Scan<'a> {
    src: &'a str,
    b: &'a [u8],
    i: usize,
    depth: u32,
}

impl<'a> Scan<'a> {
    /// Skips JSON whitespace (exactly serde_json's four bytes) and returns the next byte.
    fn peek(&mut self) -> Option<u8> {
        while let Some(&c) = self.b.get(self.i) {
            if !matches!(c, b' ' | b'\n' | b'\t' | b'\r') {
                return Some(c);
            }
            self.i += 1;
        }
        None
    }

    fn eat(&mut self, c: u8) -> Option<()> {
        (self.peek()? == c).then(|| self.i += 1)
    }

    /// Nothing but whitespace is left.
    fn end(&mut self) -> Option<()> {
        self.peek().is_none().then_some(())
    }

    fn literal(&mut self, word: &[u8]) -> Option<()> {
        self.peek()?;
        let end = self.i.checked_add(word.len())?;
        (self.b.get(self.i..end)? == word).then(|| self.i = end)
    }

    /// Whether the next value is `null` (then consumed).
    fn null(&mut self) -> Option<bool> {
        if self.peek()? == b'n' {
            self.literal(b"null")?;
            return Some(true);
        }
        Some(false)
    }

    /// A string without escapes, as a slice of the body.
    fn str(&mut self) -> Option<&'a str> {
        self.eat(b'"')?;
        let start = self.i;
        self.i = start + plain_len(self.b.get(start..)?);
        // Escapes (decoding needed) and control characters (an error) decline.
        if self.b.get(self.i) != Some(&b'"') {
            return None;
        }
        let s = self.src.get(start..self.i)?;
        self.i += 1;
        Some(s)
    }

    fn str_or_null(&mut self) -> Option<Option<&'a str>> {
        if self.null()? {
            return Some(None);
        }
        self.str().map(Some)
    }

    fn bool_or_null(&mut self) -> Option<Option<bool>> {
        match self.peek()? {
            b't' => self.literal(b"true").map(|()| Some(true)),
            b'f' => self.literal(b"false").map(|()| Some(false)),
            _ => self.null()?.then_some(None),
        }
    }

    /// Steps over a string, checking its escapes as serde_json does for a `str`: `\"`,
    /// `\\`, `\/`, `\b`, `\f`, `\n`, `\r`, `\t`, `\u` with four hex digits, a surrogate only
    /// as a leading one followed by a trailing one; no control characters. Returns
    /// whether it had a `\u` escape.
    fn skip_str(&mut self) -> Option<bool> {
        self.eat(b'"')?;
        let mut unicode = false;
        loop {
            self.i += plain_len(self.b.get(self.i..)?);
            let c = *self.b.get(self.i)?;
            self.i += 1;
            match c {
                b'"' => return Some(unicode),
                b'\\' => {
                    let e = *self.b.get(self.i)?;
                    self.i += 1;
                    match e {
                        b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => {}
                        b'u' => {
                            unicode = true;
                            let n = self.hex4()?;
                            if (0xDC00..=0xDFFF).contains(&n) {
                                return None;
                            }
                            if (0xD800..=0xDBFF).contains(&n) {
                                if self.b.get(self.i..self.i.checked_add(2)?)? != b"\\u" {
                                    return None;
                                }
                                self.i += 2;
                                if !(0xDC00..=0xDFFF).contains(&self.hex4()?) {
                                    return None;
                                }
                            }
                        }
                        _ => return None,
                    }
                }
                // A control character.
                _ => return None,
            }
        }
    }

    fn hex4(&mut self) -> Option<u16> {
        let digits = self.b.get(self.i..self.i.checked_add(4)?)?;
        let mut n = 0u16;
        for &d in digits {
            let v = char::from(d).to_digit(16)?;
            n = (n << 4) | u16::try_from(v).ok()?;
        }
        self.i += 4;
        Some(n)
    }

    /// Steps over a number in JSON's grammar, returning its text. Declines an exponent or
    /// more than [`MAX_DIGITS`] characters: those could overflow an `f64`, which
    /// serde_json refuses.
    fn number(&mut self) -> Option<&'a str> {
        self.peek()?;
        let start = self.i;
        let digits = |s: &mut Self| {
            let from = s.i;
            while s.b.get(s.i).is_some_and(u8::is_ascii_digit) {
                s.i += 1;
            }
            s.i - from
        };
        if self.b.get(self.i) == Some(&b'-') {
            self.i += 1;
        }
        match self.b.get(self.i)? {
            // One leading zero, not followed by a digit.
            b'0' => {
                self.i += 1;
                if self.b.get(self.i).is_some_and(u8::is_ascii_digit) {
                    return None;
                }
            }
            b'1'..=b'9' => {
                digits(self);
            }
            _ => return None,
        }
        if self.b.get(self.i) == Some(&b'.') {
            self.i += 1;
            if digits(self) == 0 {
                return None;
            }
        }
        if matches!(self.b.get(self.i), Some(b'e' | b'E')) || self.i - start > MAX_DIGITS {
            return None;
        }
        self.src.get(start..self.i)
    }

    /// `spec.priority` as the reference path reads it (`Value::as_i64`, then i32): an
    /// integer that fits both, else 0 (a fraction, an integer out of range, `null`).
    /// Other types decline.
    fn priority(&mut self) -> Option<i32> {
        if self.null()? {
            return Some(0);
        }
        let text = self.number()?;
        if text.contains('.') {
            return Some(0);
        }
        // serde_json reads an integer beyond i64 as u64 or f64; `as_i64` gives None.
        Some(
            text.parse::<i64>()
                .ok()
                .and_then(|n| i32::try_from(n).ok())
                .unwrap_or(0),
        )
    }

    /// Steps over any value.
    fn skip(&mut self) -> Option<()> {
        match self.peek()? {
            b'"' => self.skip_str().map(|_| ()),
            b'{' => self.object_raw_keys(|s, _| s.skip()),
            b'[' => self.array(Self::skip),
            b't' => self.literal(b"true"),
            b'f' => self.literal(b"false"),
            b'n' => self.literal(b"null"),
            b'-' | b'0'..=b'9' => self.number().map(|_| ()),
            _ => None,
        }
    }

    /// An object, calling `field` with each key (whose value it must consume). A key with
    /// escapes is passed as its raw text, which never equals a field kvota reads.
    fn object(&mut self, mut field: impl FnMut(&mut Self, &str) -> Option<()>) -> Option<()> {
        self.object_raw_keys(|s, key| match key {
            Key::Plain(k) => field(s, k),
            Key::Escaped => s.skip(),
        })
    }

    fn object_raw_keys(&mut self, mut field: impl FnMut(&mut Self, Key<'a>) -> Option<()>) -> Option<()> {
        self.eat(b'{')?;
        self.depth += 1;
        if self.depth > MAX_DEPTH {
            return None;
        }
        if self.peek()? == b'}' {
            self.i += 1;
        } else {
            loop {
                let key = self.key()?;
                self.eat(b':')?;
                field(self, key)?;
                match self.peek()? {
                    b',' => self.i += 1,
                    b'}' => {
                        self.i += 1;
                        break;
                    }
                    _ => return None,
                }
            }
        }
        self.depth -= 1;
        Some(())
    }

    /// An object's key. One with `\u` escapes declines (it could spell serde_json's
    /// private token); so does the token itself.
    fn key(&mut self) -> Option<Key<'a>> {
        self.peek()?;
        let start = self.i;
        if let Some(k) = self.str() {
            return (!k.starts_with(SERDE_JSON_PRIVATE)).then_some(Key::Plain(k));
        }
        // Not a plain string: read it again as an escaped one.
        self.i = start;
        (!self.skip_str()?).then_some(Key::Escaped)
    }

    /// An array, calling `element` for each element (which it must consume).
    fn array(&mut self, mut element: impl FnMut(&mut Self) -> Option<()>) -> Option<()> {
        self.eat(b'[')?;
        self.depth += 1;
        if self.depth > MAX_DEPTH {
            return None;
        }
        if self.peek()? == b']' {
            self.i += 1;
        } else {
            loop {
                element(self)?;
                match self.peek()? {
                    b',' => self.i += 1,
                    b']' => {
                        self.i += 1;
                        break;
                    }
                    _ => return None,
                }
            }
        }
        self.depth -= 1;
        Some(())
    }
}

#[cfg(test)]
mod tests;
