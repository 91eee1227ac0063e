//! The fast way to read a review: only the fields kvota uses, deserialized straight from
//! the body into small structs whose strings borrow from it; everything else is skipped
//! without building anything. A created pod's requests are counted as they are read:
//! each quantity parsed by the core's `parse_quantity_milli`, the pod's request of each
//! resource combined by the core's `container_request_milli` and `pod_request_milli`
//! (the rules `effective_requests_milli` uses), without the core's per-container maps.
//! Reading into a `serde_json::Value` first and counting a `PodResources` (the reference
//! path, [`super::read_value`]) costs several times more: a map node and a `String` for
//! every key and value of the whole pod, then a map per container.
//!
//! [`read`] is strict where the reference path is lenient. A field of a type it does not
//! expect (`"containers": null`, a container that is not an object, a quantity that is
//! neither a string nor a number, ...), a quantity that does not parse, a request it
//! would answer with an error, or any shape it was not written for makes it return
//! `None`, and the caller reads the body the reference way. So [`read`] only ever
//! answers when its answer is the reference path's; every error message and every odd
//! case comes from the reference code, as before. The unit tests check this over the
//! real AdmissionRequests in the fixtures and over random variations of them (random
//! pods with init containers, sidecars, overhead and bad quantities among them).
//!
//! What keeps the two in step:
//! - Skipped values are still parsed as a `Value` parses them (strings checked for UTF-8
//!   and escapes, numbers for range, nesting for depth), through `deserialize_any`, not
//!   serde_json's lenient `ignored_any`: a body the reference path rejects as not JSON is
//!   never accepted here.
//! - A key seen twice keeps its last value, as a `Value` map does.
//! - `null` is taken as a missing field exactly where the reference path's
//!   `.and_then(Value::as_str)` / `pointer` does the same; elsewhere it sends the body to
//!   the reference path.
//! - serde_json gives a map whose key is one of its private tokens (`$serde_json::private::…`,
//!   used for raw values) a special meaning when building a `Value`; such a key sends the
//!   body to the reference path.

use std::borrow::Cow;
use std::fmt;
use std::marker::PhantomData;

use kvota_fairness::resources::{container_request_milli, pod_request_milli};
use kvota_fairness::units::parse_quantity_milli;
use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};

use super::{pass, Create, ParsedKind, PodRequests};

/// Reads a review body (already checked for size) the fast way; `None` means "read it
/// the reference way" (see the module documentation).
pub(super) fn read(body: &[u8]) -> Option<ParsedKind> {
    // Checked for UTF-8 once, whole: parsing from a str spares serde_json a check per
    // string. (A body that is not UTF-8 is not JSON: the reference path says so.)
    let body = std::str::from_utf8(body).ok()?;
    let Obj(doc): Obj<Review<'_>> = serde_json::from_str(body).ok()?;
    let (Some(api), Some(kind), Some(req)) = (doc.api_version, doc.kind, doc.request) else { return None };
    if api.0 != "admission.k8s.io/v1" || kind.0 != "AdmissionReview" {
        return None;
    }
    let uid = req.uid.filter(|u| !u.0.is_empty())?.0;
    let (group, res) = req.resource.map_or((None, None), |r| (r.group, r.resource));
    let (group, res) = (group.as_ref().map_or("", |s| &s.0), res.as_ref().map_or("", |s| &s.0));
    if res != "pods" || !group.is_empty() {
        return Some(ParsedKind::Done(pass(&uid, &format!("kvota: {group}/{res} is not judged (only pods)"))));
    }
    if req.sub_resource.is_some_and(|s| !s.0.is_empty()) {
        return Some(ParsedKind::Done(pass(&uid, "kvota: pod subresources are not judged")));
    }
    // `object` absent, `null`, or an object; only the last has metadata.
    let object = req.object.as_ref().and_then(Option::as_ref);
    let meta = object.and_then(|o| o.metadata.as_ref());
    let namespace = req.namespace.as_ref().or(meta.and_then(|m| m.namespace.as_ref())).map_or("", |s| &s.0).to_string();
    let name = req
        .name
        .as_ref()
        .filter(|n| !n.0.is_empty())
        .or(meta.and_then(|m| m.name.as_ref()))
        .map_or("", |s| &s.0)
        .to_string();
    let key = if name.is_empty() {
        let prefix = meta.and_then(|m| m.generate_name.as_ref()).map_or("", |s| &s.0);
        format!("{namespace}/{prefix}*{uid}")
    } else {
        format!("{namespace}/{name}")
    };
    let dry_run = req.dry_run.unwrap_or(false);
    match req.operation.as_ref().map(|o| &*o.0) {
        Some("CREATE") => {}
        Some("DELETE") => return Some(ParsedKind::Delete { uid: uid.into_owned(), key, dry_run }),
        Some("UPDATE" | "CONNECT") => return Some(ParsedKind::Done(pass(&uid, ""))),
        // An unknown or missing operation is an error: the reference path words it.
        _ => return None,
    }
    // A CREATE without an object, or whose object is null or has no spec, is an error.
    let spec = req.object?.and_then(|o| o.spec)?;
    // A null spec is read as an empty pod, as the reference path reads it.
    let spec = spec.unwrap_or_default();
    let pod = PodRequests::Counted(Ok(spec.requests()));
    Some(ParsedKind::Create(Box::new(Create {
        uid: uid.into_owned(),
        namespace,
        name,
        key,
        dry_run,
        pod,
        priority: spec.priority.0,
        has_gates: spec.has_gates,
    })))
}

/// The top of an AdmissionReview.
#[derive(Default)]
struct Review<'a> {
    api_version: Option<Str<'a>>,
    kind: Option<Str<'a>>,
    request: Option<Request<'a>>,
}

/// `request`: the AdmissionRequest.
#[derive(Default)]
struct Request<'a> {
    uid: Option<Str<'a>>,
    resource: Option<GroupResource<'a>>,
    sub_resource: Option<Str<'a>>,
    namespace: Option<Str<'a>>,
    name: Option<Str<'a>>,
    operation: Option<Str<'a>>,
    dry_run: Option<bool>,
    /// Absent (`None`), `null` (`Some(None)`), or the object.
    object: Option<Option<Object<'a>>>,
}

/// `request.resource`.
#[derive(Default)]
struct GroupResource<'a> {
    group: Option<Str<'a>>,
    resource: Option<Str<'a>>,
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
    namespace: Option<Str<'a>>,
    name: Option<Str<'a>>,
    generate_name: Option<Str<'a>>,
}

/// `request.object.spec`: what the pod requests.
#[derive(Default)]
struct Spec<'a> {
    priority: Priority,
    has_gates: bool,
    init_containers: Vec<Container<'a>>,
    containers: Vec<Container<'a>>,
    overhead: Quantities<'a>,
}

impl Spec<'_> {
    /// The pod's request of every resource it names, sorted by name: what
    /// [`effective_requests_milli`](kvota_fairness::resources::effective_requests_milli)
    /// returns for the same pod (every quantity parsed already, none invalid), counted
    /// with the core's own rules ([`container_request_milli`], [`pod_request_milli`]) but
    /// without building its maps.
    fn requests(&self) -> Vec<(String, u64)> {
        let all = self.init_containers.iter().chain(&self.containers);
        let mut names: Vec<&str> = all
            .flat_map(|c| c.requests.0.iter().chain(&c.limits.0))
            .chain(&self.overhead.0)
            .map(|(name, _)| &**name)
            .collect();
        names.sort_unstable();
        names.dedup();
        names
            .into_iter()
            .map(|name| {
                let milli = pod_request_milli(
                    self.containers.iter().map(|c| c.request(name)),
                    self.init_containers.iter().map(|c| (c.restartable, c.request(name))),
                    self.overhead.get(name).unwrap_or(0),
                );
                (name.to_owned(), milli)
            })
            .collect()
    }
}

/// One entry of `spec.containers` or `spec.initContainers`: its requests and limits,
/// and whether it is a sidecar. (Its name only ever appears in an error, and errors come
/// from the reference path.)
#[derive(Default)]
struct Container<'a> {
    restartable: bool,
    requests: Quantities<'a>,
    limits: Quantities<'a>,
}

impl Container<'_> {
    fn request(&self, resource: &str) -> u64 {
        container_request_milli(self.requests.get(resource), self.limits.get(resource))
    }
}

/// A container's `resources`.
#[derive(Default)]
struct Resources<'a> {
    requests: Quantities<'a>,
    limits: Quantities<'a>,
}

/// The fields of one JSON object that a struct keeps.
trait Fields<'de>: Default {
    /// Reads the value of `key` into `self`, or skips it. A later duplicate of a key
    /// overwrites the earlier one, as in a `Value` map.
    fn field<A: MapAccess<'de>>(&mut self, key: &str, map: &mut A) -> Result<(), A::Error>;
}

/// A JSON object read through [`Fields`]; `null` or any other type is an error.
struct Obj<T>(T);

impl<'de, T: Fields<'de>> Deserialize<'de> for Obj<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<T>(PhantomData<T>);
        impl<'de, T: Fields<'de>> Visitor<'de> for V<T> {
            type Value = Obj<T>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Obj<T>, A::Error> {
                let mut out = T::default();
                while let Some(Str(key)) = map.next_key::<Str<'de>>()? {
                    out.field(&key, &mut map)?;
                }
                Ok(Obj(out))
            }
        }
        d.deserialize_map(V(PhantomData))
    }
}

/// Reads an object, or `None` for `null`.
fn nullable_obj<'de, T: Fields<'de>, A: MapAccess<'de>>(map: &mut A) -> Result<Option<T>, A::Error> {
    Ok(map.next_value::<Option<Obj<T>>>()?.map(|o| o.0))
}

/// Reads a string, or `None` for `null` (`.and_then(Value::as_str)` reads both as
/// missing).
fn nullable_str<'de, A: MapAccess<'de>>(map: &mut A) -> Result<Option<Str<'de>>, A::Error> {
    map.next_value::<Option<Str<'de>>>()
}

/// Skips the value of a key kvota does not read, refusing serde_json's private keys.
fn skip<'de, A: MapAccess<'de>>(key: &str, map: &mut A) -> Result<(), A::Error> {
    if key.starts_with(SERDE_JSON_PRIVATE) {
        return Err(de::Error::custom("serde_json private key"));
    }
    map.next_value::<Skip>().map(|_| ())
}

/// The prefix of the keys serde_json treats specially when it builds a `Value`.
const SERDE_JSON_PRIVATE: &str = "$serde_json::private::";

impl<'de> Fields<'de> for Review<'de> {
    fn field<A: MapAccess<'de>>(&mut self, key: &str, map: &mut A) -> Result<(), A::Error> {
        match key {
            "apiVersion" => self.api_version = nullable_str(map)?,
            "kind" => self.kind = nullable_str(map)?,
            // A request that is not an object is answered with an error.
            "request" => self.request = Some(map.next_value::<Obj<Request<'de>>>()?.0),
            _ => skip(key, map)?,
        }
        Ok(())
    }
}

impl<'de> Fields<'de> for Request<'de> {
    fn field<A: MapAccess<'de>>(&mut self, key: &str, map: &mut A) -> Result<(), A::Error> {
        match key {
            "uid" => self.uid = nullable_str(map)?,
            "resource" => self.resource = nullable_obj(map)?,
            "subResource" => self.sub_resource = nullable_str(map)?,
            "namespace" => self.namespace = nullable_str(map)?,
            "name" => self.name = nullable_str(map)?,
            "operation" => self.operation = nullable_str(map)?,
            "dryRun" => self.dry_run = map.next_value::<Option<bool>>()?,
            "object" => self.object = Some(nullable_obj(map)?),
            _ => skip(key, map)?,
        }
        Ok(())
    }
}

impl<'de> Fields<'de> for GroupResource<'de> {
    fn field<A: MapAccess<'de>>(&mut self, key: &str, map: &mut A) -> Result<(), A::Error> {
        match key {
            "group" => self.group = nullable_str(map)?,
            "resource" => self.resource = nullable_str(map)?,
            _ => skip(key, map)?,
        }
        Ok(())
    }
}

impl<'de> Fields<'de> for Object<'de> {
    fn field<A: MapAccess<'de>>(&mut self, key: &str, map: &mut A) -> Result<(), A::Error> {
        match key {
            "metadata" => self.metadata = nullable_obj(map)?,
            "spec" => self.spec = Some(nullable_obj(map)?),
            _ => skip(key, map)?,
        }
        Ok(())
    }
}

impl<'de> Fields<'de> for Metadata<'de> {
    fn field<A: MapAccess<'de>>(&mut self, key: &str, map: &mut A) -> Result<(), A::Error> {
        match key {
            "namespace" => self.namespace = nullable_str(map)?,
            "name" => self.name = nullable_str(map)?,
            "generateName" => self.generate_name = nullable_str(map)?,
            _ => skip(key, map)?,
        }
        Ok(())
    }
}

impl<'de> Fields<'de> for Spec<'de> {
    fn field<A: MapAccess<'de>>(&mut self, key: &str, map: &mut A) -> Result<(), A::Error> {
        match key {
            "priority" => self.priority = map.next_value()?,
            "schedulingGates" => self.has_gates = map.next_value::<Gates>()?.0,
            // Lists of objects; `null` or anything else is an error.
            "initContainers" => self.init_containers = map.next_value::<Containers<'de>>()?.0,
            "containers" => self.containers = map.next_value::<Containers<'de>>()?.0,
            // An object of quantities; `null` is an error.
            "overhead" => self.overhead = map.next_value()?,
            _ => skip(key, map)?,
        }
        Ok(())
    }
}

impl<'de> Fields<'de> for Container<'de> {
    fn field<A: MapAccess<'de>>(&mut self, key: &str, map: &mut A) -> Result<(), A::Error> {
        match key {
            "restartPolicy" => self.restartable = nullable_str(map)?.is_some_and(|p| p.0 == "Always"),
            // `null` resources hold nothing, as in the reference path.
            "resources" => {
                let r = nullable_obj::<Resources<'de>, A>(map)?.unwrap_or_default();
                (self.requests, self.limits) = (r.requests, r.limits);
            }
            _ => skip(key, map)?,
        }
        Ok(())
    }
}

impl<'de> Fields<'de> for Resources<'de> {
    fn field<A: MapAccess<'de>>(&mut self, key: &str, map: &mut A) -> Result<(), A::Error> {
        match key {
            // Objects of quantities; `null` is an error.
            "requests" => self.requests = map.next_value()?,
            "limits" => self.limits = map.next_value()?,
            _ => skip(key, map)?,
        }
        Ok(())
    }
}

/// A list of containers, each an object.
struct Containers<'a>(Vec<Container<'a>>);

impl<'de> Deserialize<'de> for Containers<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Containers<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a list of containers")
            }
            fn visit_seq<S: SeqAccess<'de>>(self, mut seq: S) -> Result<Containers<'de>, S::Error> {
                let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(16));
                while let Some(Obj(c)) = seq.next_element::<Obj<Container<'de>>>()? {
                    out.push(c);
                }
                Ok(Containers(out))
            }
        }
        d.deserialize_seq(V)
    }
}

/// A JSON string: borrowed from the body, or owned when it had escapes.
struct Str<'a>(Cow<'a, str>);

impl<'de> Deserialize<'de> for Str<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Str<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E: de::Error>(self, s: &'de str) -> Result<Str<'de>, E> {
                Ok(Str(Cow::Borrowed(s)))
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Str<'de>, E> {
                Ok(Str(Cow::Owned(s.to_owned())))
            }
        }
        d.deserialize_str(V)
    }
}

/// A map of resource name to quantity, each parsed to thousandths as the core parses it
/// ([`parse_quantity_milli`]); a key seen twice keeps its last value. A number is read
/// as its `serde_json::Number` text, as the reference path reads it. A quantity that
/// does not parse, or a value that is neither a string nor a number, is an error (the
/// reference path words it).
#[derive(Default)]
struct Quantities<'a>(Vec<(Cow<'a, str>, u64)>);

impl Quantities<'_> {
    fn get(&self, resource: &str) -> Option<u64> {
        self.0.iter().find(|(name, _)| name == resource).map(|&(_, milli)| milli)
    }
}

impl<'de> Deserialize<'de> for Quantities<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Quantities<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an object of quantities")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Quantities<'de>, A::Error> {
                let mut out: Vec<(Cow<'de, str>, u64)> = Vec::new();
                while let Some(Str(key)) = map.next_key::<Str<'de>>()? {
                    if key.starts_with(SERDE_JSON_PRIVATE) {
                        return Err(de::Error::custom("serde_json private key"));
                    }
                    let Quantity(milli) = map.next_value()?;
                    match out.iter_mut().find(|(name, _)| *name == key) {
                        Some(entry) => entry.1 = milli,
                        None => out.push((key, milli)),
                    }
                }
                Ok(Quantities(out))
            }
        }
        d.deserialize_map(V)
    }
}

/// One quantity, parsed: a string, or a number as `serde_json::Number` writes it.
struct Quantity(u64);

impl<'de> Deserialize<'de> for Quantity {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        fn parse<E: de::Error>(text: &str) -> Result<Quantity, E> {
            parse_quantity_milli(text).map(Quantity).map_err(|_| E::custom("not a quantity"))
        }
        struct V;
        impl Visitor<'_> for V {
            type Value = Quantity;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a quantity")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Quantity, E> {
                parse(s)
            }
            fn visit_u64<E: de::Error>(self, n: u64) -> Result<Quantity, E> {
                parse(&serde_json::Number::from(n).to_string())
            }
            fn visit_i64<E: de::Error>(self, n: i64) -> Result<Quantity, E> {
                parse(&serde_json::Number::from(n).to_string())
            }
            fn visit_f64<E: de::Error>(self, n: f64) -> Result<Quantity, E> {
                // The parser yields finite numbers only; anything else goes the reference way.
                let n = serde_json::Number::from_f64(n).ok_or_else(|| E::custom("not a finite number"))?;
                parse(&n.to_string())
            }
        }
        d.deserialize_any(V)
    }
}

/// `spec.priority` as the reference path reads it: an integer that fits i32, else 0
/// (a float, an integer out of range, `null`). Other types go the reference way.
#[derive(Default)]
struct Priority(i32);

impl<'de> Deserialize<'de> for Priority {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Priority;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a priority")
            }
            fn visit_u64<E: de::Error>(self, n: u64) -> Result<Priority, E> {
                // `Value::as_i64` refuses integers above i64::MAX.
                Ok(Priority(i64::try_from(n).ok().and_then(|n| i32::try_from(n).ok()).unwrap_or(0)))
            }
            fn visit_i64<E: de::Error>(self, n: i64) -> Result<Priority, E> {
                Ok(Priority(i32::try_from(n).unwrap_or(0)))
            }
            fn visit_f64<E: de::Error>(self, _: f64) -> Result<Priority, E> {
                Ok(Priority(0))
            }
            fn visit_unit<E: de::Error>(self) -> Result<Priority, E> {
                Ok(Priority(0))
            }
        }
        d.deserialize_any(V)
    }
}

/// `spec.schedulingGates`: whether it is a list (`null` is not). Other types go the
/// reference way.
struct Gates(bool);

impl<'de> Deserialize<'de> for Gates {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Gates;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a list of scheduling gates")
            }
            fn visit_seq<S: SeqAccess<'de>>(self, seq: S) -> Result<Gates, S::Error> {
                SkipVisitor.visit_seq(seq).map(|_| Gates(true))
            }
            fn visit_unit<E: de::Error>(self) -> Result<Gates, E> {
                Ok(Gates(false))
            }
        }
        d.deserialize_any(V)
    }
}

/// Any JSON value, parsed as a `Value` would be and dropped.
struct Skip;

impl<'de> Deserialize<'de> for Skip {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(SkipVisitor)
    }
}

struct SkipVisitor;

impl<'de> Visitor<'de> for SkipVisitor {
    type Value = Skip;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Skip, E> {
        Ok(Skip)
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<Skip, E> {
        Ok(Skip)
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> Result<Skip, E> {
        Ok(Skip)
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Skip, E> {
        Ok(Skip)
    }
    fn visit_str<E: de::Error>(self, _: &str) -> Result<Skip, E> {
        Ok(Skip)
    }
    fn visit_unit<E: de::Error>(self) -> Result<Skip, E> {
        Ok(Skip)
    }
    fn visit_seq<S: SeqAccess<'de>>(self, mut seq: S) -> Result<Skip, S::Error> {
        while seq.next_element::<Skip>()?.is_some() {}
        Ok(Skip)
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Skip, A::Error> {
        while let Some(Str(key)) = map.next_key::<Str<'de>>()? {
            skip(&key, &mut map)?;
        }
        Ok(Skip)
    }
}

#[cfg(test)]
mod tests;
