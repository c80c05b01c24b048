//! What this CPU can run, detected once ([`CpuFeatures::get`]), and the
//! tokens that prove it.
//!
//! Every SIMD kernel of vl is reached through a token: [`Isa`] for the
//! f32 kernels (matrix-vector products, attention, GELU, the q4_K
//! quantizer), [`Q8Isa`] for the q8_0 and q4_K products, [`Bf16Isa`] for
//! the bf16 GEMM, LayerNorm and additions. A token's field is private:
//! the only way to hold one naming an instruction set is to ask
//! [`CpuFeatures`] for it, which hands out only what the CPU has. So a
//! function that takes a token may call `#[target_feature]` code for the
//! instruction set it names; no caller can pass one the CPU lacks.
//!
//! Besides the instruction sets, [`CpuFeatures`] holds the vendor, the
//! family and model, and the model name: what tuning per CPU reads, and
//! what `vl bench` prints beside its figures.

use std::fmt;
use std::sync::OnceLock;

/// The CPU's maker, as far as tuning cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Vendor {
    /// `AuthenticAMD`.
    Amd,
    /// `GenuineIntel`.
    Intel,
    /// An Arm core (aarch64).
    Arm,
    /// Anything else.
    Other,
}

/// The instruction sets of the f32 kernels, best first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Simd {
    /// x86-64 with AVX-512F.
    Avx512,
    /// x86-64 with AVX2 and FMA.
    Avx2,
    /// aarch64 with NEON (Advanced SIMD, part of its baseline).
    Neon,
    /// The target's baseline, plain Rust (the fallback and the test
    /// oracle of every kernel).
    Portable,
}

/// The instruction sets of the q8_0 and q4_K products, best first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Q8Simd {
    /// [`Q8Simd::Vnni`] plus AMX-BF16: an encoder's many rows
    /// ([`crate::kernels::q8_amx::MIN_ROWS`] and more per product) on the
    /// tile unit, the weight's tiles widened to bf16 as a task reads them
    /// and `x` rounded to bf16 rather than to q8_0 (see
    /// [`crate::kernels::q8_amx`]); fewer rows as on VNNI.
    Amx,
    /// x86-64 with AVX-512F, AVX-512BW and AVX-512 VNNI: intrinsics.
    Vnni,
    /// x86-64 with AVX2 and FMA: plain Rust compiled for them.
    Avx2,
    /// aarch64 with NEON and the dot-product extension (`sdot`).
    NeonDot,
    /// The target's baseline: plain Rust.
    Portable,
}

/// The instruction sets of the bf16 kernels (GEMM, LayerNorm, additions),
/// best first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Bf16Simd {
    /// [`Bf16Simd::Avx512Bf16`] plus AMX-BF16: the GEMM's blocks of 32 rows
    /// on the tile unit (`tdpbf16ps`, 16 × 16 outputs × 32 products per
    /// instruction), everything else as on AVX512_BF16.
    Amx,
    /// x86-64 with AVX-512F and AVX512_BF16 (`vdpbf16ps`, `vcvtneps2bf16`).
    Avx512Bf16,
    /// The same CPUs, the GEMM's products on AVX-512F FMAs instead: each
    /// pair of bf16 weights widened to two f32 (exact), f32 activations
    /// kept as they are (not rounded to bf16), everything else as on
    /// AVX512_BF16. Chosen where `vdpbf16ps` runs at a lower rate than
    /// the FMAs ([`Bf16Gemm::Fma`]).
    Avx512Fma,
    /// The target's baseline: plain Rust.
    Portable,
}

/// Proof that this CPU runs an instruction set of the f32 kernels: made
/// only by [`CpuFeatures`] (or [`Isa::portable`], which every CPU runs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Isa(Simd);

/// Proof that this CPU runs an instruction set of the q8_0 and q4_K
/// products: made only by [`CpuFeatures`] (or [`Q8Isa::portable`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Q8Isa(Q8Simd);

/// Proof that this CPU runs an instruction set of the bf16 kernels: made
/// only by [`CpuFeatures`] (or [`Bf16Isa::portable`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Bf16Isa(Bf16Simd);

impl Isa {
    /// The baseline, which every CPU runs.
    pub const fn portable() -> Self {
        Self(Simd::Portable)
    }

    /// The instruction set this token proves.
    pub const fn simd(self) -> Simd {
        self.0
    }
}

impl Q8Isa {
    /// The baseline, which every CPU runs.
    pub const fn portable() -> Self {
        Self(Q8Simd::Portable)
    }

    /// The instruction set this token proves.
    pub const fn simd(self) -> Q8Simd {
        self.0
    }

    /// The f32 kernels' token for the parts of a q8_0 product written in
    /// plain Rust (the rounding of `x`, the products without VNNI): an
    /// instruction set this one implies, so no new detection is needed.
    pub const fn f32_isa(self) -> Isa {
        Isa(match self.0 {
            Q8Simd::Amx | Q8Simd::Vnni => Simd::Avx512,
            Q8Simd::Avx2 => Simd::Avx2,
            Q8Simd::NeonDot => Simd::Neon,
            Q8Simd::Portable => Simd::Portable,
        })
    }
}

impl Bf16Isa {
    /// The baseline, which every CPU runs.
    pub const fn portable() -> Self {
        Self(Bf16Simd::Portable)
    }

    /// The instruction set this token proves.
    pub const fn simd(self) -> Bf16Simd {
        self.0
    }

    /// The f32 kernels' token this one implies (AVX512_BF16 comes with
    /// AVX-512F).
    pub const fn f32_isa(self) -> Isa {
        Isa(match self.0 {
            Bf16Simd::Amx | Bf16Simd::Avx512Bf16 | Bf16Simd::Avx512Fma => Simd::Avx512,
            Bf16Simd::Portable => Simd::Portable,
        })
    }
}

/// The cache hint of the prefetches that vl's weight-streaming kernels
/// issue ahead of the bytes they multiply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefetchHint {
    /// `PREFETCHNTA`: into the nearest cache, marked to leave first.
    NonTemporal,
    /// `PREFETCHT0`: into every level.
    T0,
    /// No software prefetch (the hardware's alone).
    Off,
}

/// Which f32 matrix product runs the products of many rows (an encoder, a
/// prefill) on this CPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum F32Gemm {
    /// candle's (the `gemm` crate's AVX2 micro-kernels on x86-64).
    Candle,
    /// vl's own ([`crate::kernels::gemm_f32`]), on the best [`Isa`]: AVX-512
    /// at full width where the CPU runs 512-bit FMAs at full rate.
    Vl,
}

/// Which products run the bf16-weight GEMM (an encoder, a prefill under
/// bf16 weights) on CPUs with AVX512_BF16 where the tile unit does not.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bf16Gemm {
    /// `vdpbf16ps`: two bf16 products per f32 lane and instruction,
    /// activations rounded to bf16 ([`Bf16Simd::Avx512Bf16`]).
    Dot,
    /// FMAs on the weights widened to f32, activations in f32
    /// ([`Bf16Simd::Avx512Fma`]): where `vdpbf16ps` runs at a quarter of
    /// the FMAs' rate in instructions, which is half of it in products.
    Fma,
}

/// The choices of vl's kernels that depend on the CPU model rather than on
/// its instruction sets, made once at detection ([`Tuning::for_cpu`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tuning {
    /// The hint of the weight streams' prefetches.
    pub prefetch: PrefetchHint,
    /// How many bytes ahead of the weights being multiplied they ask.
    pub prefetch_ahead: usize,
    /// The f32 product of many rows.
    pub f32_gemm: F32Gemm,
    /// The bf16-weight product of many rows where the tile unit does not
    /// take it: which of [`Bf16Simd::Avx512Bf16`] and
    /// [`Bf16Simd::Avx512Fma`] is the best token.
    pub bf16_gemm: Bf16Gemm,
}

impl Tuning {
    /// The prefetch distance measured best on every host so far: the
    /// hardware's stream prefetcher starts over at every 4 KB page, and
    /// each product starts a new stream. Interleaved `vl bench` runs of
    /// vit-gpt2 on a 2-core Zen 5 against no prefetch, ms/token: q8_0
    /// 3.42–3.76 vs 3.74–4.49 (4 pairs), bf16 weights 5.16–5.69 vs
    /// 5.81–6.60, `--dtype bf16` 6.00–6.42 vs 6.74–7.18, f32 12.06–12.38 vs
    /// 14.21–14.98 (3 pairs each); 2 KB and 8 KB ahead gained less or as
    /// much.
    pub const PREFETCH_AHEAD: usize = 4096;

    /// The tuning for a CPU of `vendor` (BENCHMARKS.md, "Tuning per CPU"):
    ///
    /// - AMD (Zen 4, Zen 5): non-temporal prefetches 4 KB ahead — the
    ///   measurements above;
    /// - Intel (Sapphire Rapids class Xeon, model 207) and any other x86
    ///   CPU: `PREFETCHT0` 4 KB ahead. On that Xeon the non-temporal hint
    ///   lost most of what the prefetch gains (`vl bench --quick
    ///   --threads 2`, q8_0 ms/token: NTA 15.8–17.5, none 11.96–14.2, T0
    ///   9.1–11.3; f32: NTA 43.5–64, T0 42.8–43.3);
    /// - aarch64: no x86 prefetch exists (the hint is not used).
    ///
    /// The f32 product of many rows is vl's own AVX-512 one
    /// ([`F32Gemm::Vl`]) on the CPUs with AVX-512F whose cores run 512-bit
    /// FMAs at full rate: Intel's, and AMD's from Zen 5 (family 26) on.
    /// Elsewhere candle's (gemm's AVX2 kernels): on Zen 4 (family 25)
    /// AVX-512 is double-pumped, and gemm's AVX-512 kernels made a ViT
    /// encode 30% slower there. On the Intel Xeon model 207 vl's product
    /// of a ViT-B's four shapes at 197 rows took 13.0 ms against gemm's
    /// AVX-512 kernels' 15.3 (BENCHMARKS.md, "Intel Xeon"); on Zen 5
    /// gemm's AVX-512 kernels beat its AVX2 ones by 24% (f32 encode), and
    /// vl's own there is yet to be measured.
    ///
    /// The bf16-weight product of many rows, where the tile unit does not
    /// run it, is FMAs on widened weights ([`Bf16Gemm::Fma`]) on Intel and
    /// `vdpbf16ps` ([`Bf16Gemm::Dot`]) elsewhere. On the Intel Xeon model
    /// 207 (without AMX granted) one thread ran 1.28 G `vdpbf16ps` a second
    /// against 5.29 G 512-bit FMAs (82 against 169 GFLOP/s), and the
    /// FMA product of a ViT-B's shapes beat the `vdpbf16ps` one by
    /// BENCHMARKS.md's "Intel Xeon model 207" figures; AMD's Zen 4 and Zen
    /// 5 keep the `vdpbf16ps` product they were measured on.
    ///
    /// `VL_PREFETCH=nta|t0|off[:BYTES]`, `VL_F32_GEMM=vl|candle` and
    /// `VL_BF16_GEMM=dot|fma` in the environment override these (to
    /// measure a new CPU); a value that does not parse is ignored with a
    /// warning on stderr.
    pub fn for_cpu(vendor: Vendor, family: u32, avx512f: bool) -> Self {
        let prefetch = match vendor {
            Vendor::Amd => PrefetchHint::NonTemporal,
            Vendor::Intel | Vendor::Other | Vendor::Arm => PrefetchHint::T0,
        };
        let f32_gemm = match std::env::var("VL_F32_GEMM") {
            Ok(v) => match Self::parse_f32_gemm(&v) {
                Some(g) => g,
                None => {
                    eprintln!("vl: VL_F32_GEMM={v:?} ignored: expected vl or candle");
                    Self::f32_gemm_for(vendor, family, avx512f)
                }
            },
            Err(_) => Self::f32_gemm_for(vendor, family, avx512f),
        };
        let bf16_for = match vendor {
            Vendor::Intel => Bf16Gemm::Fma,
            Vendor::Amd | Vendor::Arm | Vendor::Other => Bf16Gemm::Dot,
        };
        let bf16_gemm = match std::env::var("VL_BF16_GEMM") {
            Ok(v) => Self::parse_bf16_gemm(&v).unwrap_or_else(|| {
                eprintln!("vl: VL_BF16_GEMM={v:?} ignored: expected dot or fma");
                bf16_for
            }),
            Err(_) => bf16_for,
        };
        let tuning = Self {
            prefetch,
            prefetch_ahead: Self::PREFETCH_AHEAD,
            f32_gemm,
            bf16_gemm,
        };
        match std::env::var("VL_PREFETCH") {
            Ok(v) => match tuning.with_override(&v) {
                Some(t) => t,
                None => {
                    eprintln!(
                        "vl: VL_PREFETCH={v:?} ignored: expected nta, t0 or off, optionally :BYTES (e.g. t0:4096)"
                    );
                    tuning
                }
            },
            Err(_) => tuning,
        }
    }

    /// The f32 product of many rows for a CPU of `vendor` (see
    /// [`Tuning::for_cpu`]).
    fn f32_gemm_for(vendor: Vendor, family: u32, avx512f: bool) -> F32Gemm {
        let full_width = match vendor {
            Vendor::Intel => true,
            Vendor::Amd => family >= 26,
            Vendor::Arm | Vendor::Other => false,
        };
        if avx512f && full_width {
            F32Gemm::Vl
        } else {
            F32Gemm::Candle
        }
    }

    /// `vl` or `candle`, any case; `None` otherwise.
    fn parse_f32_gemm(spec: &str) -> Option<F32Gemm> {
        match spec.trim().to_ascii_lowercase().as_str() {
            "vl" => Some(F32Gemm::Vl),
            "candle" => Some(F32Gemm::Candle),
            _ => None,
        }
    }

    /// `dot` or `fma`, any case; `None` otherwise.
    fn parse_bf16_gemm(spec: &str) -> Option<Bf16Gemm> {
        match spec.trim().to_ascii_lowercase().as_str() {
            "dot" => Some(Bf16Gemm::Dot),
            "fma" => Some(Bf16Gemm::Fma),
            _ => None,
        }
    }

    /// `self` with the prefetch of `spec` (`nta`, `t0` or `off`, optionally
    /// `:BYTES`); `None` when it does not parse.
    pub fn with_override(self, spec: &str) -> Option<Self> {
        let (hint, ahead) = match spec.split_once(':') {
            Some((h, a)) => (h, Some(a.trim().parse::<usize>().ok()?)),
            None => (spec, None),
        };
        let prefetch = match hint.trim().to_ascii_lowercase().as_str() {
            "nta" => PrefetchHint::NonTemporal,
            "t0" => PrefetchHint::T0,
            "off" | "none" => PrefetchHint::Off,
            _ => return None,
        };
        Some(Self {
            prefetch,
            prefetch_ahead: ahead.unwrap_or(self.prefetch_ahead),
            ..self
        })
    }
}

/// The CPU as vl's kernels see it, detected once per process.
#[derive(Debug, Clone)]
pub struct CpuFeatures {
    /// The maker.
    pub vendor: Vendor,
    /// x86's display family (`cpuid` leaf 1, extended family added): 25
    /// for Zen 3/4, 26 for Zen 5, 6 for Intel's cores; 0 elsewhere.
    pub family: u32,
    /// x86's display model (extended model added); 0 elsewhere.
    pub model: u32,
    /// The brand string (`cpuid` 0x80000002–4 on x86-64, `/proc/cpuinfo`
    /// elsewhere where it says), trimmed; empty if unknown.
    pub model_name: String,
    /// AVX-512 Foundation.
    pub avx512f: bool,
    /// AVX-512 byte and word instructions.
    pub avx512bw: bool,
    /// AVX-512 VNNI (`vpdpbusd`).
    pub avx512vnni: bool,
    /// AVX512_BF16 (`vdpbf16ps`, `vcvtneps2bf16`).
    pub avx512bf16: bool,
    /// AMX-BF16 and AMX-TILE, usable: the operating system granted this
    /// process the tile state (Linux's `arch_prctl(ARCH_REQ_XCOMP_PERM)`,
    /// asked at detection). `VL_AMX=off` in the environment leaves it
    /// unused (to measure the AVX512_BF16 kernels on such a CPU).
    pub amx_bf16: bool,
    /// AVX2.
    pub avx2: bool,
    /// FMA3.
    pub fma: bool,
    /// aarch64 Advanced SIMD.
    pub neon: bool,
    /// aarch64 dot product (`sdot`, `udot`).
    pub dotprod: bool,
    /// The L2 cache of one core, in bytes, where the CPU says (`cpuid`
    /// 0x80000006 on x86-64, which Intel and AMD both fill; Linux's
    /// `/sys/devices/system/cpu/cpu0/cache` elsewhere): 2 MB on Intel's
    /// Sapphire Rapids class Xeons, 1 MB on Zen 4 and Zen 5. Blocked
    /// products size their blocks from it.
    pub l2_bytes: Option<usize>,
    /// The choices that depend on the CPU model (prefetch hint and
    /// distance), made once at detection.
    pub tuning: Tuning,
    /// The best tokens, chosen once at detection (each product asks).
    best: (Isa, Q8Isa, Bf16Isa),
}

impl CpuFeatures {
    /// This CPU's features, detected on the first call.
    pub fn get() -> &'static CpuFeatures {
        static CPU: OnceLock<CpuFeatures> = OnceLock::new();
        CPU.get_or_init(CpuFeatures::detect)
    }

    fn detect() -> CpuFeatures {
        let mut cpu = CpuFeatures {
            vendor: Vendor::Other,
            family: 0,
            model: 0,
            model_name: String::new(),
            avx512f: false,
            avx512bw: false,
            avx512vnni: false,
            avx512bf16: false,
            amx_bf16: false,
            avx2: false,
            fma: false,
            neon: false,
            dotprod: false,
            l2_bytes: None,
            tuning: Tuning {
                prefetch: PrefetchHint::T0,
                prefetch_ahead: Tuning::PREFETCH_AHEAD,
                f32_gemm: F32Gemm::Candle,
                bf16_gemm: Bf16Gemm::Dot,
            },
            best: (Isa::portable(), Q8Isa::portable(), Bf16Isa::portable()),
        };
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            cpu.avx512f = has!("avx512f");
            cpu.avx512bw = has!("avx512bw");
            cpu.avx512vnni = has!("avx512vnni");
            cpu.avx512bf16 = has!("avx512bf16");
            cpu.amx_bf16 = !matches!(
                std::env::var("VL_AMX").as_deref().map(str::trim),
                Ok("off" | "0")
            ) && x86::amx_bf16_usable();
            cpu.avx2 = has!("avx2");
            cpu.fma = has!("fma");
            let id = x86::identify();
            cpu.vendor = id.vendor;
            cpu.family = id.family;
            cpu.model = id.model;
            cpu.model_name = id.brand;
            cpu.l2_bytes = x86::l2_bytes();
        }
        #[cfg(target_arch = "aarch64")]
        {
            use std::arch::is_aarch64_feature_detected as has;
            cpu.vendor = Vendor::Arm;
            cpu.neon = has!("neon");
            cpu.dotprod = has!("dotprod");
        }
        if cpu.model_name.is_empty() {
            cpu.model_name = proc_cpuinfo_model().unwrap_or_default();
        }
        if cpu.l2_bytes.is_none() {
            cpu.l2_bytes = sysfs_l2_bytes();
        }
        // The tuning first: it orders the bf16 tokens.
        cpu.tuning = Tuning::for_cpu(cpu.vendor, cpu.family, cpu.avx512f);
        cpu.best = (cpu.isas()[0], cpu.q8_isas()[0], cpu.bf16_isas()[0]);
        cpu
    }

    /// The best [`Isa`] of this CPU.
    pub fn isa(&self) -> Isa {
        self.best.0
    }

    /// Every [`Isa`] this CPU runs, best first, [`Isa::portable`] last.
    pub fn isas(&self) -> Vec<Isa> {
        [Simd::Avx512, Simd::Avx2, Simd::Neon, Simd::Portable]
            .into_iter()
            .filter_map(|s| self.isa_for(s))
            .collect()
    }

    /// The token for `simd`, if this CPU runs it.
    pub fn isa_for(&self, simd: Simd) -> Option<Isa> {
        let ok = match simd {
            Simd::Avx512 => self.avx512f,
            Simd::Avx2 => self.avx2 && self.fma,
            Simd::Neon => self.neon,
            Simd::Portable => true,
        };
        ok.then_some(Isa(simd))
    }

    /// The best [`Q8Isa`] of this CPU.
    pub fn q8_isa(&self) -> Q8Isa {
        self.best.1
    }

    /// Every [`Q8Isa`] this CPU runs, best first, [`Q8Isa::portable`]
    /// last.
    pub fn q8_isas(&self) -> Vec<Q8Isa> {
        [
            Q8Simd::Amx,
            Q8Simd::Vnni,
            Q8Simd::Avx2,
            Q8Simd::NeonDot,
            Q8Simd::Portable,
        ]
        .into_iter()
        .filter_map(|s| self.q8_isa_for(s))
        .collect()
    }

    /// The token for `simd`, if this CPU runs it.
    pub fn q8_isa_for(&self, simd: Q8Simd) -> Option<Q8Isa> {
        let ok = match simd {
            Q8Simd::Amx => {
                self.avx512f && self.avx512bw && self.avx512vnni && self.avx512bf16 && self.amx_bf16
            }
            Q8Simd::Vnni => self.avx512f && self.avx512bw && self.avx512vnni,
            Q8Simd::Avx2 => self.avx2 && self.fma,
            Q8Simd::NeonDot => self.neon && self.dotprod,
            Q8Simd::Portable => true,
        };
        ok.then_some(Q8Isa(simd))
    }

    /// The best [`Bf16Isa`] of this CPU.
    pub fn bf16_isa(&self) -> Bf16Isa {
        self.best.2
    }

    /// Every [`Bf16Isa`] this CPU runs, best first, [`Bf16Isa::portable`]
    /// last.
    pub fn bf16_isas(&self) -> Vec<Bf16Isa> {
        let dot_first = [Bf16Simd::Amx, Bf16Simd::Avx512Bf16, Bf16Simd::Avx512Fma];
        let fma_first = [Bf16Simd::Amx, Bf16Simd::Avx512Fma, Bf16Simd::Avx512Bf16];
        let order = match self.tuning.bf16_gemm {
            Bf16Gemm::Dot => dot_first,
            Bf16Gemm::Fma => fma_first,
        };
        order
            .into_iter()
            .chain([Bf16Simd::Portable])
            .filter_map(|s| self.bf16_isa_for(s))
            .collect()
    }

    /// The token for `simd`, if this CPU runs it.
    pub fn bf16_isa_for(&self, simd: Bf16Simd) -> Option<Bf16Isa> {
        let ok = match simd {
            Bf16Simd::Amx => self.avx512f && self.avx512bf16 && self.amx_bf16,
            Bf16Simd::Avx512Bf16 | Bf16Simd::Avx512Fma => self.avx512f && self.avx512bf16,
            Bf16Simd::Portable => true,
        };
        ok.then_some(Bf16Isa(simd))
    }

    /// The instruction-set flags vl's kernels look at that this CPU has,
    /// as `lscpu` spells them.
    pub fn flags(&self) -> Vec<&'static str> {
        [
            (self.avx2, "avx2"),
            (self.fma, "fma"),
            (self.avx512f, "avx512f"),
            (self.avx512bw, "avx512bw"),
            (self.avx512vnni, "avx512_vnni"),
            (self.avx512bf16, "avx512_bf16"),
            (self.amx_bf16, "amx_bf16"),
            (self.neon, "neon"),
            (self.dotprod, "asimddp"),
        ]
        .into_iter()
        .filter_map(|(on, name)| on.then_some(name))
        .collect()
    }
}

impl fmt::Display for CpuFeatures {
    /// `MODEL NAME (vendor, family F model M): flags; L2 N KB; kernels f32
    /// X, q8_0 Y, bf16 Z; prefetch HINT N B ahead; f32 GEMM G`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = if self.model_name.is_empty() {
            "unknown CPU"
        } else {
            &self.model_name
        };
        write!(
            f,
            "{name} ({:?}, family {} model {}): {}; L2 {}; kernels f32 {:?}, q8_0 {:?}, bf16 {:?}; prefetch {:?} {} B ahead; f32 GEMM {:?}",
            self.vendor,
            self.family,
            self.model,
            self.flags().join(" "),
            self.l2_bytes
                .map_or("unknown".to_string(), |b| format!("{} KB", b >> 10)),
            self.isa().simd(),
            self.q8_isa().simd(),
            self.bf16_isa().simd(),
            self.tuning.prefetch,
            self.tuning.prefetch_ahead,
            self.tuning.f32_gemm
        )
    }
}

/// Plausible per-core L2 sizes: a value outside (a hypervisor's zero, a
/// misread field) is taken as unknown.
const L2_RANGE: std::ops::RangeInclusive<usize> = (64 << 10)..=(64 << 20);

/// The L2 of CPU 0 from Linux's sysfs (`cache/indexN` whose `level` is 2
/// and `type` Data or Unified; `size` as `2048K`), where there is one.
fn sysfs_l2_bytes() -> Option<usize> {
    let root = std::path::Path::new("/sys/devices/system/cpu/cpu0/cache");
    (0..8).find_map(|i| {
        let dir = root.join(format!("index{i}"));
        let read = |f: &str| std::fs::read_to_string(dir.join(f)).ok();
        let level = read("level")?;
        let kind = read("type")?;
        if level.trim() != "2" || kind.trim() == "Instruction" {
            return None;
        }
        parse_cache_size(read("size")?.trim())
    })
}

/// `2048K`, `1M` or a plain byte count, as sysfs writes cache sizes.
fn parse_cache_size(s: &str) -> Option<usize> {
    let (digits, shift) = match s.strip_suffix('K') {
        Some(d) => (d, 10),
        None => s.strip_suffix('M').map_or((s, 0), |d| (d, 20)),
    };
    let n: usize = digits.parse().ok()?;
    let bytes = n.checked_mul(1 << shift)?;
    L2_RANGE.contains(&bytes).then_some(bytes)
}

/// The `model name` line of `/proc/cpuinfo`, where there is one.
fn proc_cpuinfo_model() -> Option<String> {
    let info = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    info.lines()
        .find_map(|l| {
            let (key, value) = l.split_once(':')?;
            (key.trim() == "model name").then(|| value.trim().to_string())
        })
        .filter(|s| !s.is_empty())
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::{__cpuid, __cpuid_count, CpuidResult};

    use super::Vendor;

    /// Whether the CPU has AMX-TILE and AMX-BF16 (`cpuid` leaf 7, EDX bits
    /// 24 and 22) and the operating system lets this process use the tile
    /// data: on Linux, `arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`
    /// succeeds (it fails where the kernel or the hypervisor does not
    /// enable the state); elsewhere, no.
    pub(super) fn amx_bf16_usable() -> bool {
        if cpuid(0).eax < 7 {
            return false;
        }
        // SAFETY: leaf 7 exists (checked above).
        #[allow(unused_unsafe)]
        let edx = unsafe { __cpuid_count(7, 0) }.edx;
        let (tile, bf16) = (edx & (1 << 24) != 0, edx & (1 << 22) != 0);
        tile && bf16 && request_tile_data()
    }

    #[cfg(target_os = "linux")]
    fn request_tile_data() -> bool {
        const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
        const XFEATURE_XTILEDATA: libc::c_long = 18;
        // SAFETY: a request for a permission of this process; no memory
        // is passed.
        unsafe {
            libc::syscall(
                libc::SYS_arch_prctl,
                ARCH_REQ_XCOMP_PERM,
                XFEATURE_XTILEDATA,
            ) == 0
        }
    }

    #[cfg(not(target_os = "linux"))]
    fn request_tile_data() -> bool {
        false
    }

    /// The L2 per core, `cpuid` 0x80000006 ECX bits 31–16 (KB), where the
    /// leaf exists and the value is plausible.
    pub(super) fn l2_bytes() -> Option<usize> {
        if cpuid(0x8000_0000).eax < 0x8000_0006 {
            return None;
        }
        let kb = (cpuid(0x8000_0006).ecx >> 16) as usize;
        let bytes = kb << 10;
        super::L2_RANGE.contains(&bytes).then_some(bytes)
    }

    pub(super) struct Identity {
        pub vendor: Vendor,
        pub family: u32,
        pub model: u32,
        pub brand: String,
    }

    fn cpuid(leaf: u32) -> CpuidResult {
        // SAFETY: CPUID exists on every x86-64 CPU; leaves past the
        // maximum return zeros or the highest basic leaf's values, which
        // the callers check against leaf 0's and 0x80000000's maximums.
        #[allow(unused_unsafe)]
        unsafe {
            __cpuid(leaf)
        }
    }

    pub(super) fn identify() -> Identity {
        let l0 = cpuid(0);
        let mut vendor_bytes = [0u8; 12];
        for (i, r) in [l0.ebx, l0.edx, l0.ecx].iter().enumerate() {
            vendor_bytes[4 * i..4 * i + 4].copy_from_slice(&r.to_le_bytes());
        }
        let vendor = match &vendor_bytes {
            b"AuthenticAMD" => Vendor::Amd,
            b"GenuineIntel" => Vendor::Intel,
            _ => Vendor::Other,
        };
        let (mut family, mut model) = (0, 0);
        if l0.eax >= 1 {
            let eax = cpuid(1).eax;
            let base_family = (eax >> 8) & 0xf;
            let base_model = (eax >> 4) & 0xf;
            family = base_family;
            model = base_model;
            if base_family == 0xf {
                family += (eax >> 20) & 0xff;
            }
            if base_family == 0xf || base_family == 0x6 {
                model += ((eax >> 16) & 0xf) << 4;
            }
        }
        let mut brand = Vec::with_capacity(48);
        if cpuid(0x8000_0000).eax >= 0x8000_0004 {
            for leaf in 0x8000_0002..=0x8000_0004 {
                let r = cpuid(leaf);
                for v in [r.eax, r.ebx, r.ecx, r.edx] {
                    brand.extend_from_slice(&v.to_le_bytes());
                }
            }
        }
        let brand = String::from_utf8_lossy(&brand)
            .trim_matches(|c: char| c == '\0' || c.is_whitespace())
            .to_string();
        Identity {
            vendor,
            family,
            model,
            brand,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Cache sizes as sysfs writes them; implausible ones are unknown. The
    /// detected L2, where there is one, is in the plausible range.
    #[test]
    fn l2_sizes_parse_and_detect() {
        assert_eq!(parse_cache_size("2048K"), Some(2 << 20));
        assert_eq!(parse_cache_size("1M"), Some(1 << 20));
        assert_eq!(parse_cache_size("524288"), Some(512 << 10));
        for bad in ["", "K", "0K", "12X", "32K", "1024M", "-1K"] {
            assert_eq!(parse_cache_size(bad), None, "{bad:?}");
        }
        let cpu = CpuFeatures::get();
        assert!(cpu.l2_bytes.is_none_or(|b| L2_RANGE.contains(&b)), "{cpu}");
        assert!(cpu.to_string().contains("; L2 "), "{cpu}");
    }

    /// The portable tokens are always handed out, last; every token handed
    /// out matches the flags; the best is the first.
    #[test]
    fn tokens_follow_the_flags() {
        let cpu = CpuFeatures::get();
        assert_eq!(cpu.isas().last(), Some(&Isa::portable()));
        assert_eq!(cpu.q8_isas().last(), Some(&Q8Isa::portable()));
        assert_eq!(cpu.bf16_isas().last(), Some(&Bf16Isa::portable()));
        assert_eq!(cpu.isa(), cpu.isas()[0]);
        assert_eq!(cpu.q8_isa(), cpu.q8_isas()[0]);
        assert_eq!(cpu.bf16_isa(), cpu.bf16_isas()[0]);
        for isa in cpu.isas() {
            let ok = match isa.simd() {
                Simd::Avx512 => cpu.avx512f,
                Simd::Avx2 => cpu.avx2 && cpu.fma,
                Simd::Neon => cpu.neon,
                Simd::Portable => true,
            };
            assert!(ok, "{isa:?} handed out on {cpu}");
        }
        for isa in cpu.q8_isas() {
            // What a q8_0 token implies for the f32 kernels is handed out too.
            assert!(cpu.isas().contains(&isa.f32_isa()), "{isa:?} on {cpu}");
            let vnni = cpu.avx512f && cpu.avx512bw && cpu.avx512vnni;
            let ok = match isa.simd() {
                // The tile unit's route widens to bf16 (AVX512_BF16) and
                // keeps VNNI for a decode step's rows.
                Q8Simd::Amx => vnni && cpu.avx512bf16 && cpu.amx_bf16,
                Q8Simd::Vnni => vnni,
                Q8Simd::Avx2 => cpu.avx2 && cpu.fma,
                Q8Simd::NeonDot => cpu.neon && cpu.dotprod,
                Q8Simd::Portable => true,
            };
            assert!(ok, "{isa:?} handed out on {cpu}");
        }
        for isa in cpu.bf16_isas() {
            assert!(cpu.isas().contains(&isa.f32_isa()), "{isa:?} on {cpu}");
            let ok = match isa.simd() {
                Bf16Simd::Amx => cpu.amx_bf16 && cpu.avx512bf16,
                Bf16Simd::Avx512Bf16 | Bf16Simd::Avx512Fma => cpu.avx512bf16 && cpu.avx512f,
                Bf16Simd::Portable => true,
            };
            assert!(ok, "{isa:?} handed out on {cpu}");
        }
        // Without the tile unit, the tuning picks the first of the two
        // AVX-512 tokens.
        if !cpu.amx_bf16 && cpu.avx512bf16 && cpu.avx512f {
            let want = match cpu.tuning.bf16_gemm {
                Bf16Gemm::Dot => Bf16Simd::Avx512Bf16,
                Bf16Gemm::Fma => Bf16Simd::Avx512Fma,
            };
            assert_eq!(cpu.bf16_isa().simd(), want, "{cpu}");
        }
        #[cfg(target_arch = "x86_64")]
        {
            assert_eq!(cpu.avx512f, std::arch::is_x86_feature_detected!("avx512f"));
            assert_ne!(cpu.vendor, Vendor::Arm);
        }
        #[cfg(target_arch = "aarch64")]
        {
            assert_eq!(cpu.neon, std::arch::is_aarch64_feature_detected!("neon"));
            assert_eq!(cpu.isa().simd(), Simd::Neon);
        }
        assert!(cpu.to_string().contains("kernels f32"));
        // The CPU a test run saw, in its log (`--nocapture`).
        eprintln!("{cpu}");
    }

    /// The prefetch is chosen by vendor (non-temporal on AMD, T0
    /// elsewhere), 4 KB ahead; `VL_PREFETCH`'s forms parse, anything else
    /// is refused; the detected CPU says its choice.
    #[test]
    fn tuning_per_vendor_and_its_override() {
        let base = |prefetch| Tuning {
            prefetch,
            prefetch_ahead: Tuning::PREFETCH_AHEAD,
            f32_gemm: F32Gemm::Candle,
            bf16_gemm: Bf16Gemm::Dot,
        };
        let overridden = ["VL_PREFETCH", "VL_F32_GEMM", "VL_BF16_GEMM"]
            .iter()
            .any(|v| std::env::var_os(v).is_some());
        if !overridden {
            for avx512f in [false, true] {
                for family in [25, 26] {
                    let zen = Tuning::for_cpu(Vendor::Amd, family, avx512f);
                    assert_eq!(zen.prefetch, PrefetchHint::NonTemporal);
                    let vl = avx512f && family == 26;
                    assert_eq!(zen.f32_gemm == F32Gemm::Vl, vl, "family {family}");
                }
                for v in [Vendor::Other, Vendor::Arm] {
                    assert_eq!(
                        Tuning::for_cpu(v, 0, avx512f),
                        base(PrefetchHint::T0),
                        "{v:?}"
                    );
                }
            }
            let intel = Tuning {
                bf16_gemm: Bf16Gemm::Fma,
                ..base(PrefetchHint::T0)
            };
            assert_eq!(Tuning::for_cpu(Vendor::Intel, 6, false), intel);
            assert_eq!(
                Tuning::for_cpu(Vendor::Intel, 6, true),
                Tuning {
                    f32_gemm: F32Gemm::Vl,
                    ..intel
                }
            );
            let cpu = CpuFeatures::get();
            assert_eq!(
                cpu.tuning,
                Tuning::for_cpu(cpu.vendor, cpu.family, cpu.avx512f)
            );
            assert!(cpu.to_string().contains("B ahead"), "{cpu}");
            assert!(cpu.to_string().contains("f32 GEMM"), "{cpu}");
        }
        assert_eq!(Tuning::parse_f32_gemm(" VL "), Some(F32Gemm::Vl));
        assert_eq!(Tuning::parse_f32_gemm("candle"), Some(F32Gemm::Candle));
        assert_eq!(Tuning::parse_f32_gemm("avx512"), None);
        assert_eq!(Tuning::parse_bf16_gemm(" FMA"), Some(Bf16Gemm::Fma));
        assert_eq!(Tuning::parse_bf16_gemm("dot"), Some(Bf16Gemm::Dot));
        assert_eq!(Tuning::parse_bf16_gemm("amx"), None);
        let t = base(PrefetchHint::NonTemporal);
        assert_eq!(t.with_override("t0"), Some(base(PrefetchHint::T0)));
        assert_eq!(t.with_override("OFF"), Some(base(PrefetchHint::Off)));
        assert_eq!(
            t.with_override("nta:2048"),
            Some(Tuning {
                prefetch: PrefetchHint::NonTemporal,
                prefetch_ahead: 2048,
                ..base(PrefetchHint::NonTemporal)
            })
        );
        for bad in ["", "t1", "t0:", "t0:4k", "nta:-1"] {
            assert_eq!(t.with_override(bad), None, "{bad:?}");
        }
    }
}
