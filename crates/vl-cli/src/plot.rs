//! Line charts as PNG files, drawn with plotters on an in-memory bitmap and
//! encoded with `image`: the pictures of `vl experiment` and of
//! `vl train-shapes --train-curve`.
//!
//! A figure is a row (or grid) of [`Panel`]s, each a set of named
//! [`Series`] over shared axes, linear or logarithmic. The font (DejaVu
//! Sans Mono, its licence beside it in `assets/`) is compiled in, so
//! plotting needs nothing from the machine.

use std::path::Path;
use std::sync::Once;

use anyhow::Context;
use plotters::coord::ranged1d::{AsRangedCoord, ValueFormatter};
use plotters::prelude::*;
use plotters::style::{register_font, FontStyle};

/// The compiled-in font.
const FONT: &[u8] = include_bytes!("../assets/DejaVuSansMono.ttf");
/// The family name the font is registered under.
pub(crate) const FAMILY: &str = "sans-serif";

/// Registers the compiled-in font under [`FAMILY`], once per process.
pub(crate) fn ensure_font() {
    static FONT_ONCE: Once = Once::new();
    FONT_ONCE.call_once(|| {
        // The bytes are compiled in and known to parse; a failure would
        // show as missing text, and drawing would report it.
        let _ = register_font(FAMILY, FontStyle::Normal, FONT);
    });
}

/// Line colours, in series order (colour-blind safe, Okabe–Ito).
const PALETTE: [RGBColor; 7] = [
    RGBColor(0, 114, 178),
    RGBColor(213, 94, 0),
    RGBColor(0, 158, 115),
    RGBColor(204, 121, 167),
    RGBColor(230, 159, 0),
    RGBColor(86, 180, 233),
    RGBColor(0, 0, 0),
];

/// One named line.
#[derive(Debug, Clone)]
pub struct Series {
    /// Legend text.
    pub label: String,
    /// `(x, y)` points, drawn in order.
    pub points: Vec<(f64, f64)>,
    /// Dashed (a reference line) rather than solid.
    pub dashed: bool,
}

impl Series {
    /// A solid line.
    pub fn new(label: impl Into<String>, points: Vec<(f64, f64)>) -> Self {
        Self {
            label: label.into(),
            points,
            dashed: false,
        }
    }

    /// The same line, dashed.
    pub fn dashed(self) -> Self {
        Self {
            dashed: true,
            ..self
        }
    }
}

/// An axis: its label, its range (from the data when `None`) and scale.
#[derive(Debug, Clone, Default)]
pub struct Axis {
    /// Label under or beside the axis.
    pub label: String,
    /// Fixed range; `None` fits the data.
    pub range: Option<(f64, f64)>,
    /// Logarithmic (all values must be positive).
    pub log: bool,
}

impl Axis {
    /// A linear axis fitted to the data.
    pub fn linear(label: impl Into<String>) -> Self {
        Self {
            label: label.into(),
            ..Self::default()
        }
    }

    /// A logarithmic axis fitted to the data.
    pub fn log(label: impl Into<String>) -> Self {
        Self {
            label: label.into(),
            log: true,
            ..Self::default()
        }
    }

    /// The same axis over a fixed range.
    pub fn range(self, lo: f64, hi: f64) -> Self {
        Self {
            range: Some((lo, hi)),
            ..self
        }
    }
}

/// One chart: a title, two axes, lines.
#[derive(Debug, Clone)]
pub struct Panel {
    /// Caption above the chart.
    pub title: String,
    /// Horizontal axis.
    pub x: Axis,
    /// Vertical axis.
    pub y: Axis,
    /// The lines.
    pub series: Vec<Series>,
    /// Where the legend goes (default: lower right).
    pub legend: Legend,
}

/// A corner of the chart for the legend.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Legend {
    /// Top left.
    UpperLeft,
    /// Top right.
    UpperRight,
    /// Bottom left.
    LowerLeft,
    /// Bottom right.
    #[default]
    LowerRight,
}

/// Writes `panels` as a PNG of `cols` columns (rows as needed), each panel
/// `panel_size` pixels.
///
/// # Errors
/// A panel without points, a log axis over a non-positive value, or a file
/// that cannot be written, named.
pub fn write_png(
    path: &Path,
    panels: &[Panel],
    cols: usize,
    panel_size: (u32, u32),
) -> anyhow::Result<()> {
    ensure_font();
    anyhow::ensure!(!panels.is_empty() && cols > 0, "nothing to plot");
    let cols = cols.min(panels.len());
    let rows = panels.len().div_ceil(cols);
    let (w, h) = (panel_size.0 * cols as u32, panel_size.1 * rows as u32);
    let mut pixels = vec![0u8; (w * h * 3) as usize];
    {
        let root = BitMapBackend::with_buffer(&mut pixels, (w, h)).into_drawing_area();
        root.fill(&WHITE).map_err(plot_error)?;
        let areas = root.split_evenly((rows, cols));
        for (panel, area) in panels.iter().zip(areas.iter()) {
            draw(area, panel).with_context(|| format!("panel {:?}", panel.title))?;
        }
        root.present().map_err(plot_error)?;
    }
    let img = image::RgbImage::from_raw(w, h, pixels).context("plot buffer size")?;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    }
    img.save(path)
        .with_context(|| format!("write {}", path.display()))
}

/// A tick label: four significant digits at most, no trailing zeros.
fn tick(v: &f64) -> String {
    // A tick a rounding error away from 0 reads as 0.
    if v.abs() < 1e-9 || !v.is_finite() {
        return if v.is_finite() {
            "0".into()
        } else {
            format!("{v}")
        };
    }
    let digits = (3 - v.abs().log10().floor() as i32).max(0) as usize;
    let s = format!("{v:.digits$}");
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    }
}

fn plot_error<E: std::fmt::Debug>(e: E) -> anyhow::Error {
    anyhow::anyhow!("plotters: {e:?}")
}

/// The range of an axis: fixed, or the data's with a margin.
fn fit(axis: &Axis, values: impl Iterator<Item = f64>) -> anyhow::Result<(f64, f64)> {
    if let Some(r) = axis.range {
        return Ok(r);
    }
    let (lo, hi) = values
        .filter(|v| v.is_finite())
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
            (lo.min(v), hi.max(v))
        });
    anyhow::ensure!(lo.is_finite(), "axis {:?} has no finite value", axis.label);
    if axis.log {
        anyhow::ensure!(
            lo > 0.0,
            "axis {:?} is logarithmic but has the value {lo}",
            axis.label
        );
        return Ok((lo / 1.5, hi * 1.5));
    }
    let pad = if hi > lo { 0.05 * (hi - lo) } else { 0.5 };
    Ok((lo - pad, hi + pad))
}

fn draw<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    panel: &Panel,
) -> anyhow::Result<()> {
    anyhow::ensure!(
        panel.series.iter().any(|s| !s.points.is_empty()),
        "no points"
    );
    let xs = fit(
        &panel.x,
        panel
            .series
            .iter()
            .flat_map(|s| s.points.iter().map(|p| p.0)),
    )?;
    let ys = fit(
        &panel.y,
        panel
            .series
            .iter()
            .flat_map(|s| s.points.iter().map(|p| p.1)),
    )?;
    let (x, y) = (xs.0..xs.1, ys.0..ys.1);
    match (panel.x.log, panel.y.log) {
        (false, false) => chart(area, panel, x, y),
        (true, false) => chart(area, panel, x.log_scale(), y),
        (false, true) => chart(area, panel, x, y.log_scale()),
        (true, true) => chart(area, panel, x.log_scale(), y.log_scale()),
    }
}

fn chart<DB, X, Y>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    panel: &Panel,
    x: X,
    y: Y,
) -> anyhow::Result<()>
where
    DB: DrawingBackend,
    X: AsRangedCoord<Value = f64>,
    Y: AsRangedCoord<Value = f64>,
    X::CoordDescType: ValueFormatter<f64>,
    Y::CoordDescType: ValueFormatter<f64>,
{
    let mut chart = ChartBuilder::on(area)
        .caption(&panel.title, (FAMILY, 17))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(64)
        .build_cartesian_2d(x, y)
        .map_err(plot_error)?;
    chart
        .configure_mesh()
        .x_desc(&panel.x.label)
        .y_desc(&panel.y.label)
        .x_label_formatter(&tick)
        .y_label_formatter(&tick)
        .label_style((FAMILY, 12))
        .axis_desc_style((FAMILY, 13))
        .light_line_style(RGBColor(235, 235, 235))
        .draw()
        .map_err(plot_error)?;
    for (i, s) in panel.series.iter().enumerate() {
        let colour = PALETTE[i % PALETTE.len()];
        let style = colour.stroke_width(2);
        let drawn = if s.dashed {
            chart.draw_series(DashedLineSeries::new(s.points.iter().copied(), 6, 4, style))
        } else {
            chart.draw_series(LineSeries::new(s.points.iter().copied(), style))
        }
        .map_err(plot_error)?;
        drawn
            .label(&s.label)
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 18, y)], colour.stroke_width(2)));
        if s.points.len() <= 40 {
            chart
                .draw_series(s.points.iter().map(|&p| Circle::new(p, 3, colour.filled())))
                .map_err(plot_error)?;
        }
    }
    chart
        .configure_series_labels()
        .label_font((FAMILY, 12))
        .background_style(WHITE.mix(0.85))
        .border_style(RGBColor(200, 200, 200))
        .position(match panel.legend {
            Legend::UpperLeft => SeriesLabelPosition::UpperLeft,
            Legend::UpperRight => SeriesLabelPosition::UpperRight,
            Legend::LowerLeft => SeriesLabelPosition::LowerLeft,
            Legend::LowerRight => SeriesLabelPosition::LowerRight,
        })
        .draw()
        .map_err(plot_error)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_are_short() {
        let cases = [
            (50.0, "50"),
            (0.005, "0.005"),
            (1024.0, "1024"),
            (0.125, "0.125"),
            (2.5e-5, "0.000025"),
            (0.0, "0"),
            (-2.776e-17, "0"),
        ];
        for (v, want) in cases {
            assert_eq!(tick(&v), want, "{v}");
        }
    }

    /// A two-panel figure with a log axis is written as a PNG of the
    /// expected size, with more than one colour drawn.
    #[test]
    fn writes_a_png() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("fig.png");
        let panels = [
            Panel {
                title: "linear".into(),
                x: Axis::linear("step"),
                y: Axis::linear("accuracy").range(0.0, 1.0),
                series: vec![
                    Series::new("a", vec![(0.0, 0.1), (1.0, 0.5), (2.0, 0.9)]),
                    Series::new("b", vec![(0.0, 0.2), (2.0, 0.3)]).dashed(),
                ],
                legend: Legend::UpperLeft,
            },
            Panel {
                title: "log".into(),
                x: Axis::log("tokens"),
                y: Axis::log("ms"),
                series: vec![Series::new("c", vec![(49.0, 0.1), (1024.0, 3.0)])],
                legend: Legend::default(),
            },
        ];
        write_png(&path, &panels, 2, (320, 240))?;
        let img = image::open(&path)?.to_rgb8();
        assert_eq!(img.dimensions(), (640, 240));
        let colours: std::collections::HashSet<_> = img.pixels().map(|p| p.0).collect();
        assert!(colours.len() > 10, "{} colours", colours.len());
        Ok(())
    }

    /// A log axis over a non-positive value, and a panel without points,
    /// are named errors.
    #[test]
    fn bad_panels_are_named() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("bad.png");
        let log = Panel {
            title: "bad log".into(),
            x: Axis::linear("x"),
            y: Axis::log("ms"),
            series: vec![Series::new("zero", vec![(0.0, 0.0), (1.0, 1.0)])],
            legend: Legend::default(),
        };
        let err = format!("{:#}", write_png(&path, &[log], 1, (200, 200)).unwrap_err());
        assert!(
            err.contains("bad log") && err.contains("logarithmic"),
            "{err}"
        );
        let empty = Panel {
            title: "empty".into(),
            x: Axis::linear("x"),
            y: Axis::linear("y"),
            series: vec![Series::new("none", vec![])],
            legend: Legend::default(),
        };
        let err = format!(
            "{:#}",
            write_png(&path, &[empty], 1, (200, 200)).unwrap_err()
        );
        assert!(err.contains("no points"), "{err}");
    }
}
