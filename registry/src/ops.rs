//! The op registry: which package runs a node.
//!
//! A node is described by a [`NodeQuery`]; every op entry of every package with the node's
//! domain and op type is a candidate. A candidate is rejected, with a [`Rejection`] that says
//! why, when the model's opset is outside its range, the dtype of its `dtype_input` is not
//! listed, a tensor's rank is over `max_rank`, or the device lacks what the package requires.
//! Among the rest, the package of the highest *precedence* wins (drop-in folders, then registry
//! directories in the order given, then the built-in packages), then the highest version, then
//! the first registered.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::sync::Arc;

use kiln_kernel_abi::manifest::{parse_compute_capability, OpEntry};
use kiln_kernel_abi::DType;

use crate::Package;

/// What the device of a run offers; `None` in a query means the CPU backend, where device
/// requirements do not apply.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceCaps {
    /// Compute capability (major, minor).
    pub compute_capability: (u32, u32),
    /// Features: `bf16`, `fp16`, `tf32`.
    pub features: Vec<String>,
}

/// A node to resolve.
#[derive(Clone, Debug)]
pub struct NodeQuery<'a> {
    /// `""` or `"ai.onnx"` for the default domain.
    pub domain: &'a str,
    pub op_type: &'a str,
    /// The model's opset version for the domain.
    pub opset: i64,
    /// dtype of each input (`None` where absent or unknown).
    pub input_dtypes: Vec<Option<DType>>,
    /// Largest rank among the node's inputs and outputs, where known.
    pub max_rank: Option<usize>,
    pub device: Option<&'a DeviceCaps>,
}

/// The chosen package and op entry.
#[derive(Clone, Debug)]
pub struct Resolution {
    pub package: Arc<Package>,
    pub entry: OpEntry,
    /// The package's precedence (see [`OpRegistry::add`]).
    pub precedence: u32,
}

/// Why one candidate was not chosen.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rejection {
    /// `name@version`.
    pub package: String,
    pub reason: String,
}

/// No package runs the node.
#[derive(Clone, Debug)]
pub struct Unresolved {
    pub domain: String,
    pub op_type: String,
    pub opset: i64,
    pub dtype: Option<DType>,
    pub rank: Option<usize>,
    /// Every candidate and why it was rejected (empty when no package provides the op).
    pub rejections: Vec<Rejection>,
}

impl fmt::Display for Unresolved {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let domain = if self.domain.is_empty() { "ai.onnx" } else { &self.domain };
        write!(f, "no kernel package runs {domain}::{} (opset {}", self.op_type, self.opset)?;
        if let Some(d) = self.dtype {
            write!(f, ", dtype {d}")?;
        }
        if let Some(r) = self.rank {
            write!(f, ", rank {r}")?;
        }
        write!(f, ")")?;
        if self.rejections.is_empty() {
            write!(f, ": no installed package provides this op; add a package that does (see `kiln kernels list`)")
        } else {
            for r in &self.rejections {
                write!(f, "\n  {} rejected: {}", r.package, r.reason)?;
            }
            Ok(())
        }
    }
}

/// Normalises the default domain's two spellings to `""`.
pub fn normalize_domain(domain: &str) -> &str {
    if domain == "ai.onnx" {
        ""
    } else {
        domain
    }
}

/// Index of packages by op.
#[derive(Default, Debug)]
pub struct OpRegistry {
    packages: Vec<(Arc<Package>, u32)>,
    /// (normalized domain, op type) → (package, `[[ops]]` entry) indices, in registration
    /// order: a query visits only the entries that name its op.
    by_op: HashMap<(String, String), Vec<(usize, usize)>>,
    /// Every registered name@version.
    ids: HashSet<(String, semver::Version)>,
    /// Packages taken out by policy ([`OpRegistry::exclude`]) with the reason, so that a node
    /// they would have run names them instead of saying that nothing provides its op.
    excluded: Vec<(Arc<Package>, String, u32)>,
}

/// Precedence of the built-in packages.
pub const BUILTIN: u32 = 0;
/// Precedence of packages from folders the user gives (`--packages`): above every registry.
pub const USER: u32 = 1 << 16;

/// Precedence of the packages of the `index`-th registry directory given (0 first): below
/// [`USER`], above [`BUILTIN`], an earlier registry above a later one.
pub fn registry_precedence(index: usize) -> u32 {
    USER - 1 - index.min((USER - 2) as usize) as u32
}

impl OpRegistry {
    pub fn new() -> Self {
        OpRegistry::default()
    }

    /// Adds a package with a precedence ([`BUILTIN`], [`USER`]): a candidate of higher
    /// precedence wins over any version of lower precedence. A package with the same name and
    /// version as one already present is ignored (the first registered wins) and `false` is
    /// returned.
    pub fn add(&mut self, package: Package, precedence: u32) -> bool {
        if !self.ids.insert((package.name().to_string(), package.version().clone())) {
            return false;
        }
        self.index(self.packages.len(), &package);
        self.packages.push((Arc::new(package), precedence));
        true
    }

    fn index(&mut self, at: usize, package: &Package) {
        for (e, entry) in package.manifest.ops.iter().enumerate() {
            for t in &entry.op_types {
                let key = (normalize_domain(&entry.domain).to_string(), t.clone());
                let list = self.by_op.entry(key).or_default();
                // An entry that lists the op twice is visited once.
                if list.last() != Some(&(at, e)) {
                    list.push((at, e));
                }
            }
        }
    }

    /// Keeps only the packages `keep` accepts.
    pub fn retain(&mut self, mut keep: impl FnMut(&Package) -> bool) {
        self.packages.retain(|(p, _)| keep(p));
        self.by_op.clear();
        self.ids.clear();
        let packages = std::mem::take(&mut self.packages);
        for (i, (p, _)) in packages.iter().enumerate() {
            self.ids.insert((p.name().to_string(), p.version().clone()));
            self.index(i, p);
        }
        self.packages = packages;
    }

    /// Takes out the packages `why` gives a reason for, keeping them (with it) for the errors
    /// of nodes they declare ([`OpRegistry::resolve`], [`OpRegistry::explain`]).
    pub fn exclude(&mut self, mut why: impl FnMut(&Package) -> Option<String>) {
        let mut out = Vec::new();
        for (p, precedence) in &self.packages {
            if let Some(reason) = why(p) {
                out.push((p.clone(), reason, *precedence));
            }
        }
        if out.is_empty() {
            return;
        }
        let gone: HashSet<String> = out.iter().map(|(p, ..)| p.id()).collect();
        self.retain(|p| !gone.contains(&p.id()));
        self.excluded.extend(out);
    }

    /// What an error about package `name` says of its versions: `there are …` (`available`, as
    /// the caller lists them), else the versions the policy left out with their reasons, else
    /// `none`.
    pub fn versions_note(&self, name: &str, available: &[String], none: &str) -> String {
        if !available.is_empty() {
            return format!("there are {}", available.join(", "));
        }
        let left_out: Vec<String> = self
            .excluded
            .iter()
            .filter(|(p, ..)| p.name() == name)
            .map(|(p, why, _)| format!("{} ({why})", p.id()))
            .collect();
        if left_out.is_empty() {
            none.to_string()
        } else {
            format!("left out: {}", left_out.join(", "))
        }
    }

    /// The excluded packages that declare `op_type` in `domain`, with their reasons.
    fn excluded_for<'s>(
        &'s self,
        domain: &'s str,
        op_type: &'s str,
    ) -> impl Iterator<Item = &'s (Arc<Package>, String, u32)> {
        self.excluded.iter().filter(move |(p, ..)| {
            p.manifest
                .ops
                .iter()
                .any(|e| normalize_domain(&e.domain) == domain && e.op_types.iter().any(|t| t == op_type))
        })
    }

    /// The (package, precedence, entry) candidates that name `q`'s op, in registration order.
    fn candidates<'s>(
        &'s self,
        domain: &str,
        op_type: &str,
    ) -> impl Iterator<Item = (&'s Arc<Package>, u32, &'s OpEntry)> {
        self.by_op.get(&(domain.to_string(), op_type.to_string())).into_iter().flatten().map(|&(i, e)| {
            let (p, precedence) = &self.packages[i];
            (p, *precedence, &p.manifest.ops[e])
        })
    }

    /// The package a dependency on `name` with requirement `req` resolves to, by the
    /// op-resolution rule: among the versions that meet `req`, the highest precedence, then the
    /// highest version. `None` when no registered version meets it.
    pub fn dependency(&self, name: &str, req: &semver::VersionReq) -> Option<&Arc<Package>> {
        self.packages
            .iter()
            .filter(|(p, _)| p.name() == name && req.matches(p.version()))
            .max_by(|(a, pa), (b, pb)| (pa, a.version()).cmp(&(pb, b.version())))
            .map(|(p, _)| p)
    }

    /// The headers `package`'s CUDA sources may include: its own and, transitively, those of
    /// the packages it depends on ([`OpRegistry::dependencies_for`]), by include name. Errors:
    /// as [`OpRegistry::dependencies_for`].
    pub fn includes_of(&self, package: &Package) -> Result<BTreeMap<String, String>, String> {
        self.includes_for(&package.id(), &package.headers, &package.manifest.dependencies)
    }

    /// [`OpRegistry::includes_of`] for a package not registered (one being built): `id` for
    /// messages, its own headers by include name, its `[dependencies]`.
    pub fn includes_for(
        &self,
        id: &str,
        own: &BTreeMap<String, String>,
        dependencies: &BTreeMap<String, semver::VersionReq>,
    ) -> Result<BTreeMap<String, String>, String> {
        let mut out = own.clone();
        for dep in self.dependencies_for(id, dependencies)? {
            out.extend(dep.headers.iter().map(|(k, v)| (k.clone(), v.clone())));
        }
        Ok(out)
    }

    /// The packages `dependencies` (of package `id`) resolve to, transitively, each name once
    /// ([`OpRegistry::dependency`] for the first requirement met; every other requirement on
    /// the same name must accept that version). Errors: a requirement no registered version
    /// meets, a package depending on itself, or two requirements on one name that the chosen
    /// version does not both meet, named with who requires what.
    pub fn dependencies_for(
        &self,
        id: &str,
        dependencies: &BTreeMap<String, semver::VersionReq>,
    ) -> Result<Vec<&Arc<Package>>, String> {
        let own = id.split('@').next().unwrap_or(id).to_string();
        let mut chosen: Vec<(&Arc<Package>, String)> = Vec::new();
        let mut todo: Vec<(String, semver::VersionReq, String)> =
            dependencies.iter().rev().map(|(n, r)| (n.clone(), r.clone(), id.to_string())).collect();
        while let Some((name, req, from)) = todo.pop() {
            if name == own {
                return Err(format!("{from} depends on {name} {req}, which is {id} itself (a cycle)"));
            }
            if let Some((c, by)) = chosen.iter().find(|(c, _)| c.name() == name) {
                if !req.matches(c.version()) {
                    return Err(format!(
                        "{from} depends on {name} {req}, but {} was chosen for {by}: the requirements on one \
                         package must meet one version",
                        c.id()
                    ));
                }
                continue;
            }
            let Some(dep) = self.dependency(&name, &req) else {
                let there: Vec<String> = self.packages().filter(|p| p.name() == name).map(|p| p.id()).collect();
                let note = match self.versions_note(&name, &there, "") {
                    n if n.is_empty() => String::new(),
                    n => format!(" ({n})"),
                };
                return Err(format!("{from} depends on {name} {req}, which no package source has{note}"));
            };
            chosen.push((dep, format!("{from} ({req})")));
            todo.extend(dep.manifest.dependencies.iter().rev().map(|(n, r)| (n.clone(), r.clone(), dep.id())));
        }
        Ok(chosen.into_iter().map(|(p, _)| p).collect())
    }

    /// `packages` and the packages their `[dependencies]` resolve to
    /// ([`OpRegistry::dependencies_for`]; a package whose dependencies cannot be met adds none),
    /// each once, in that order: what a lock must pin for them to build.
    pub fn with_dependencies<'a>(&'a self, packages: &[&'a Package]) -> Vec<&'a Package> {
        let mut out: Vec<&Package> = packages.to_vec();
        for p in packages {
            for d in self.dependencies_for(&p.id(), &p.manifest.dependencies).unwrap_or_default() {
                if !out.iter().any(|q| q.id() == d.id()) {
                    out.push(d);
                }
            }
        }
        out
    }

    /// Resolves every package's dependencies into its [`Package::includes`]; a package whose
    /// dependencies cannot be met is taken out ([`OpRegistry::exclude`]) with the reason, so
    /// that its nodes name it. Call it once every package is added.
    pub fn link(&mut self) {
        let mut includes = Vec::with_capacity(self.packages.len());
        let mut broken = HashMap::new();
        for (p, _) in &self.packages {
            match self.includes_of(p) {
                Ok(i) => includes.push(Some(i)),
                Err(why) => {
                    broken.insert(p.id(), why);
                    includes.push(None);
                }
            }
        }
        for ((p, _), i) in self.packages.iter_mut().zip(includes) {
            if let Some(i) = i.filter(|i| *i != p.includes) {
                Arc::make_mut(p).includes = i;
            }
        }
        self.exclude(|p| broken.get(&p.id()).cloned());
    }

    /// The packages taken out ([`OpRegistry::exclude`], [`OpRegistry::link`]) with the reason
    /// and the precedence they had.
    pub fn excluded(&self) -> impl Iterator<Item = (&Arc<Package>, &str, u32)> {
        self.excluded.iter().map(|(p, why, precedence)| (p, why.as_str(), *precedence))
    }

    /// All packages, in registration order.
    pub fn packages(&self) -> impl Iterator<Item = &Arc<Package>> {
        self.packages.iter().map(|(p, _)| p)
    }

    /// All packages with their precedence, in registration order.
    pub fn packages_with_precedence(&self) -> impl Iterator<Item = (&Arc<Package>, u32)> {
        self.packages.iter().map(|(p, n)| (p, *n))
    }

    /// The package for `q`, or every candidate's rejection.
    pub fn resolve(&self, q: &NodeQuery<'_>) -> Result<Resolution, Box<Unresolved>> {
        let domain = normalize_domain(q.domain);
        let mut rejections = Vec::new();
        let mut best: Option<(&Arc<Package>, &OpEntry, u32)> = None;
        for (pkg, precedence, entry) in self.candidates(domain, q.op_type) {
            match check(pkg, entry, q) {
                Err(reason) => rejections.push(Rejection { package: pkg.id(), reason }),
                Ok(()) => {
                    let better = best.is_none_or(|(b, _, bp)| (precedence, pkg.version()) > (bp, b.version()));
                    if better {
                        best = Some((pkg, entry, precedence));
                    }
                }
            }
        }
        let best = best.map(|(p, e, precedence)| Resolution { package: p.clone(), entry: e.clone(), precedence });
        if best.is_none() {
            for (p, reason, _) in self.excluded_for(domain, q.op_type) {
                rejections.push(Rejection { package: p.id(), reason: reason.clone() });
            }
        }
        best.ok_or_else(|| {
            Box::new(Unresolved {
                domain: domain.to_string(),
                op_type: q.op_type.to_string(),
                opset: q.opset,
                dtype: q.input_dtypes.iter().flatten().next().copied(),
                rank: q.max_rank,
                rejections,
            })
        })
    }
}

/// A version requirement on one package name (`--kernels NAME@REQ`): only the versions of
/// `name` that match `req` take part in resolution.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Requirement {
    pub name: String,
    pub req: semver::VersionReq,
}

impl std::str::FromStr for Requirement {
    type Err = String;

    /// `NAME@REQ` with a semver requirement (`kiln-unary@^1.0`, `kiln-matmul@=1.1.0`); a bare
    /// `NAME` takes any version.
    fn from_str(s: &str) -> Result<Requirement, String> {
        let (name, req) = s.split_once('@').unwrap_or((s, "*"));
        if !kiln_kernel_abi::manifest::is_package_name(name) {
            return Err(format!(
                "{s:?} is not NAME@REQUIREMENT (a package name, then a semver requirement, e.g. kiln-unary@^1.0)"
            ));
        }
        let req = req.parse().map_err(|e| format!("{s:?}: version requirement {req:?}: {e}"))?;
        Ok(Requirement { name: name.to_string(), req })
    }
}

impl fmt::Display for Requirement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}@{}", self.name, self.req)
    }
}

impl OpRegistry {
    /// Keeps, of each package name a requirement names, only the versions that meet it (every
    /// requirement on that name). Errors: a requirement no package meets, with the versions
    /// there are, so that the run never silently takes another version than the one asked for.
    pub fn require(&mut self, reqs: &[Requirement]) -> Result<(), String> {
        self.require_from(reqs, "--kernels")
    }

    /// [`OpRegistry::require`] for requirements from `origin` (`--kernels`, or the file they
    /// come from), which errors name.
    pub fn require_from(&mut self, reqs: &[Requirement], origin: &str) -> Result<(), String> {
        for r in reqs {
            let available: Vec<String> = self
                .packages
                .iter()
                .filter(|(p, _)| p.name() == r.name)
                .map(|(p, _)| format!("{} ({})", p.version(), p.origin))
                .collect();
            self.retain(|p| p.name() != r.name || r.req.matches(p.version()));
            if !self.packages.iter().any(|(p, _)| p.name() == r.name) {
                let there = self.versions_note(&r.name, &available, "no package has that name");
                return Err(format!("{origin} {r}: no package meets it; {there}"));
            }
        }
        Ok(())
    }
}

/// What became of one candidate (a package's op entry for the queried op) in [`OpRegistry::explain`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// It runs the node.
    Chosen,
    /// It supports the node, but the chosen package ranks higher (precedence, then version).
    Outranked,
    /// It does not support the node: why.
    Rejected(String),
}

/// One candidate of [`OpRegistry::explain`].
#[derive(Clone, Debug)]
pub struct Candidate {
    pub package: Arc<Package>,
    pub precedence: u32,
    pub verdict: Verdict,
}

impl OpRegistry {
    /// Every package entry that declares the queried op, with what [`OpRegistry::resolve`]
    /// made of it: the chosen one, those it outranks, and the rejected ones with their reasons;
    /// best first (precedence, then version), rejected ones last.
    pub fn explain(&self, q: &NodeQuery<'_>) -> Vec<Candidate> {
        let chosen = self.resolve(q).ok();
        let domain = normalize_domain(q.domain);
        let mut out = Vec::new();
        for (pkg, precedence, entry) in self.candidates(domain, q.op_type) {
            let verdict = match check(pkg, entry, q) {
                Err(reason) => Verdict::Rejected(reason),
                Ok(()) if chosen.as_ref().is_some_and(|c| Arc::ptr_eq(&c.package, pkg) && &c.entry == entry) => {
                    Verdict::Chosen
                }
                Ok(()) => Verdict::Outranked,
            };
            out.push(Candidate { package: pkg.clone(), precedence, verdict });
        }
        for (p, reason, precedence) in self.excluded_for(domain, q.op_type) {
            out.push(Candidate {
                package: p.clone(),
                precedence: *precedence,
                verdict: Verdict::Rejected(reason.clone()),
            });
        }
        let rank = |c: &Candidate| match c.verdict {
            Verdict::Chosen => 0,
            Verdict::Outranked => 1,
            Verdict::Rejected(_) => 2,
        };
        out.sort_by(|a, b| {
            rank(a)
                .cmp(&rank(b))
                .then_with(|| (b.precedence, b.package.version()).cmp(&(a.precedence, a.package.version())))
        });
        out
    }
}

fn check(pkg: &Package, entry: &OpEntry, q: &NodeQuery<'_>) -> Result<(), String> {
    if !entry.covers_opset(q.opset) {
        let until = entry.until_opset.map_or(String::new(), |u| u.to_string());
        return Err(format!("opset {} is outside {}..{until}", q.opset, entry.since_opset));
    }
    if let Some(Some(dtype)) = q.input_dtypes.get(entry.dtype_input) {
        if !entry.dtype_set().contains(dtype) {
            return Err(format!(
                "dtype {dtype} of input {} is not in [{}]",
                entry.dtype_input,
                entry.dtypes.join(", ")
            ));
        }
    }
    let schema = pkg.manifest.schema;
    let newer =
        q.input_dtypes.iter().enumerate().find_map(|(i, d)| d.filter(|d| d.since_schema() > schema).map(|d| (i, d)));
    if let Some((i, dtype)) = newer {
        // Its shim predates the dtype's code or layout: it could not even decode the call.
        return Err(format!(
            "input {i} is {dtype}, which packages see from manifest schema {}; this one follows schema {schema}",
            dtype.since_schema()
        ));
    }
    if let Some(rank) = q.max_rank {
        if rank > entry.max_rank {
            return Err(format!("rank {rank} is over its max_rank {}", entry.max_rank));
        }
    }
    if let Some(dev) = q.device {
        let req = &pkg.manifest.device;
        if let Some(cc) = &req.min_compute_capability {
            let need = parse_compute_capability(cc).map_err(|e| e.to_string())?;
            if dev.compute_capability < need {
                return Err(format!(
                    "needs compute capability {}.{}, the device has {}.{}",
                    need.0, need.1, dev.compute_capability.0, dev.compute_capability.1
                ));
            }
        }
        if let Some(f) = req.features.iter().find(|f| !dev.features.contains(f)) {
            return Err(format!("needs device feature {f}"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use sha2::{Digest, Sha256};

    fn package(name: &str, version: &str, dtypes: &str, cc: &str) -> Package {
        let shim = b"\0asm";
        let text = format!(
            "abi = 1\nshim = \"shim.wasm\"\n[package]\nname = \"{name}\"\nversion = \"{version}\"\n[device]\nmin_compute_capability = \"{cc}\"\n[[ops]]\nop_types = [\"Relu\"]\nsince_opset = 6\nuntil_opset = 20\ndtypes = [{dtypes}]\nmax_rank = 4\n[files]\n\"shim.wasm\" = \"{}\"\n",
            hex::encode(Sha256::digest(shim))
        );
        Package::load_files("mem", &[("kernel.toml", text.as_bytes()), ("shim.wasm", shim)]).unwrap()
    }

    /// A header-only package `name@version` exporting `include/<file>` (its text: `text`).
    fn headers(name: &str, version: &str, file: &str, text: &str) -> Package {
        let path = format!("include/{file}");
        let toml = format!(
            "schema = 4\nabi = 1\nheaders = [\"{path}\"]\n[package]\nname = \"{name}\"\nversion = \"{version}\"\n[files]\n\"{path}\" = \"{}\"\n",
            hex::encode(Sha256::digest(text))
        );
        Package::load_files("mem", &[("kernel.toml", toml.as_bytes()), (&path, text.as_bytes())]).unwrap()
    }

    /// [`package`] with `[dependencies]` `deps` (TOML lines).
    fn depending(name: &str, deps: &str) -> Package {
        let mut p = package(name, "1.0.0", "\"float32\"", "7.0");
        p.manifest.schema = 4;
        let table: toml::Table = toml::from_str(deps).unwrap();
        p.manifest.dependencies = table.into_iter().map(|(k, v)| (k, v.as_str().unwrap().parse().unwrap())).collect();
        p
    }

    #[test]
    fn dependencies_resolve_by_the_precedence_rule_and_link_their_headers() {
        let mut r = OpRegistry::new();
        r.add(headers("std", "1.0.0", "a.cuh", "// 1.0.0"), BUILTIN);
        r.add(headers("std", "1.1.0", "a.cuh", "// 1.1.0"), registry_precedence(0));
        r.add(headers("std", "1.4.0", "a.cuh", "// 1.4.0"), BUILTIN);
        r.add(headers("std", "2.0.0", "a.cuh", "// 2.0.0"), USER);
        r.add(headers("more", "1.0.0", "b.cuh", "// b"), BUILTIN);
        let req = |s: &str| s.parse::<semver::VersionReq>().unwrap();
        assert_eq!(r.dependency("std", &req("^1")).unwrap().id(), "std@1.1.0", "a registry ranks above built-ins");
        assert_eq!(r.dependency("std", &req("^2")).unwrap().id(), "std@2.0.0");
        assert!(r.dependency("std", &req("^3")).is_none());
        r.add(depending("user", "std = \"^1\"\nmore = \"^1\""), BUILTIN);
        r.add(depending("lost", "std = \"^3\""), BUILTIN);
        // A diamond whose two requirements on std no one version meets.
        let mut mid = headers("mid", "1.0.0", "m.cuh", "// m");
        mid.manifest.dependencies.insert("std".into(), req("^1"));
        r.add(mid, BUILTIN);
        r.add(depending("diamond", "mid = \"^1\"\nstd = \"^2\""), BUILTIN);
        let err = r.includes_of(r.packages().find(|p| p.name() == "diamond").unwrap()).unwrap_err();
        assert!(err.contains("diamond@1.0.0 depends on std ^2, but std@1.1.0 was chosen for mid@1.0.0 (^1)"), "{err}");
        r.link();
        assert!(r.packages().all(|p| p.name() != "diamond"), "a package whose dependencies conflict is left out");
        let user = r.packages().find(|p| p.name() == "user").unwrap();
        assert_eq!(user.includes.get("std/a.cuh").map(String::as_str), Some("// 1.1.0"));
        assert_eq!(user.includes.get("more/b.cuh").map(String::as_str), Some("// b"));
        let ids: Vec<String> = r.with_dependencies(&[user.as_ref()]).iter().map(|p| p.id()).collect();
        assert_eq!(ids, ["user@1.0.0", "more@1.0.0", "std@1.1.0"], "a lock pins the dependencies too");
        assert!(r.packages().all(|p| p.name() != "lost"), "a package whose dependency is missing is left out");
        let err = r.resolve(&query(DType::F32, 13, 1)).map(|res| res.package.id()).unwrap();
        assert_eq!(err, "user@1.0.0");
        let note = r.versions_note("lost", &[], "none");
        assert!(note.contains("lost@1.0.0 (lost@1.0.0 depends on std ^3"), "{note}");
    }

    /// A package before manifest schema 11 never sees a float8, 4-bit or 2-bit input, nor one
    /// before 12 a string, even on an input its dtype list does not govern: its shim could not
    /// decode the call.
    #[test]
    fn narrow_dtypes_go_only_to_schema_11_packages() {
        let mut r = OpRegistry::new();
        r.add(package("old", "1.0.0", "\"float32\"", "7.0"), BUILTIN);
        let mut q = query(DType::F32, 13, 1);
        q.input_dtypes.push(Some(DType::I4));
        let err = r.resolve(&q).map(|res| res.package.id()).unwrap_err().to_string();
        assert!(
            err.contains("input 1 is int4, which packages see from manifest schema 11; this one follows schema 1"),
            "{err}"
        );
        let mut new = package("new", "1.0.0", "\"float32\"", "7.0");
        new.manifest.schema = 11;
        r.add(new, BUILTIN);
        assert_eq!(r.resolve(&q).unwrap().package.id(), "new@1.0.0");
        // Strings come with schema 12.
        q.input_dtypes[1] = Some(DType::String);
        let err = r.resolve(&q).map(|res| res.package.id()).unwrap_err().to_string();
        assert!(
            err.contains("input 1 is string, which packages see from manifest schema 12; this one follows schema 11"),
            "{err}"
        );
    }

    fn query(dtype: DType, opset: i64, rank: usize) -> NodeQuery<'static> {
        NodeQuery {
            domain: "ai.onnx",
            op_type: "Relu",
            opset,
            input_dtypes: vec![Some(dtype)],
            max_rank: Some(rank),
            device: None,
        }
    }

    #[test]
    fn the_highest_compatible_version_wins() {
        let mut r = OpRegistry::new();
        r.add(package("a", "1.0.0", "\"float32\"", "7.0"), BUILTIN);
        r.add(package("a", "1.2.0", "\"float32\"", "7.0"), BUILTIN);
        r.add(package("a", "2.0.0", "\"float16\"", "7.0"), BUILTIN);
        let res = r.resolve(&query(DType::F32, 13, 2)).unwrap();
        assert_eq!(res.package.id(), "a@1.2.0");
        assert!(!r.add(package("a", "1.2.0", "\"float32\"", "7.0"), USER), "duplicates are ignored");
        // A user's package outranks built-in ones whatever its version.
        r.add(package("mine", "0.1.0", "\"float32\"", "7.0"), USER);
        assert_eq!(r.resolve(&query(DType::F32, 13, 2)).unwrap().package.id(), "mine@0.1.0");
    }

    #[test]
    fn every_rejection_is_explained() {
        let mut r = OpRegistry::new();
        r.add(package("a", "1.0.0", "\"float32\"", "9.0"), BUILTIN);
        let dev = DeviceCaps { compute_capability: (8, 0), features: vec![] };
        let e = r.resolve(&query(DType::I32, 13, 2)).unwrap_err().to_string();
        assert!(e.contains("dtype int32 of input 0 is not in [float32]"), "{e}");
        let e = r.resolve(&query(DType::F32, 21, 2)).unwrap_err().to_string();
        assert!(e.contains("opset 21 is outside 6..20"), "{e}");
        let e = r.resolve(&query(DType::F32, 13, 5)).unwrap_err().to_string();
        assert!(e.contains("rank 5 is over its max_rank 4"), "{e}");
        let mut q = query(DType::F32, 13, 2);
        q.device = Some(&dev);
        let e = r.resolve(&q).unwrap_err().to_string();
        assert!(e.contains("needs compute capability 9.0, the device has 8.0"), "{e}");
        q.op_type = "Gelu";
        let e = r.resolve(&q).unwrap_err().to_string();
        assert!(e.contains("ai.onnx::Gelu") && e.contains("no installed package provides"), "{e}");
    }
}
