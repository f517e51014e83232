//! The acceptance report as a picture: acceptance per drafted position, one group of bars per
//! position and one bar per report (e.g. the draft before and after training), as SVG.

use plotters::prelude::*;

use crate::error::{EvalError, Result};
use crate::report::AcceptanceReport;

/// Bar colours, one per report, in order (colour-blind-safe: Okabe–Ito).
const COLOURS: [RGBColor; 4] = [
    RGBColor(230, 159, 0),
    RGBColor(0, 114, 178),
    RGBColor(0, 158, 115),
    RGBColor(204, 121, 167),
];

/// An SVG chart of `P(drafted position i accepted | every earlier one accepted)` for each
/// labelled report (up to four), with each report's τ (tokens per verification, the bonus
/// counted) in its legend entry. Positions run 1..=k of the longest report. An empty list, or
/// more than four reports, is an error.
pub fn acceptance_svg(reports: &[(&str, &AcceptanceReport)]) -> Result<String> {
    if reports.is_empty() || reports.len() > COLOURS.len() {
        return Err(EvalError::Plot(format!(
            "a chart draws 1 to {} reports, not {}",
            COLOURS.len(),
            reports.len()
        )));
    }
    let k = reports
        .iter()
        .map(|(_, r)| r.per_position_acceptance.len())
        .max()
        .unwrap_or(0)
        .max(1);
    let first = reports[0].1;
    let sampling = if first.temperature == 0.0 {
        "greedy".to_string()
    } else {
        format!("temperature {}", first.temperature)
    };
    let title = format!(
        "Acceptance per drafted position ({} prompts, k = {}, {sampling})",
        first.prompts, first.k
    );
    let plot_error = |e: &dyn std::fmt::Display| EvalError::Plot(e.to_string());
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (640, 400)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| plot_error(&e))?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(48)
            .build_cartesian_2d(0.5f64..k as f64 + 0.5, 0f64..1f64)
            .map_err(|e| plot_error(&e))?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .light_line_style(WHITE)
            .x_labels(k)
            .x_label_formatter(&|x| format!("{}", x.round() as i64))
            .x_desc("drafted position")
            .y_desc("accepted, given the earlier ones")
            .y_label_formatter(&|y| format!("{:.0}%", 100.0 * y))
            .draw()
            .map_err(|e| plot_error(&e))?;
        let width = 0.8 / reports.len() as f64;
        for (n, (label, report)) in reports.iter().enumerate() {
            let colour = COLOURS[n];
            let left = |i: usize| i as f64 + 1.0 - 0.4 + n as f64 * width;
            chart
                .draw_series(
                    report
                        .per_position_acceptance
                        .iter()
                        .enumerate()
                        .map(|(i, &a)| {
                            Rectangle::new(
                                [(left(i), 0.0), (left(i) + width * 0.9, a.clamp(0.0, 1.0))],
                                colour.filled(),
                            )
                        }),
                )
                .map_err(|e| plot_error(&e))?
                .label(format!(
                    "{label}: τ {:.2}, acceptance {:.1}%",
                    report.mean_accepted_length_with_bonus,
                    100.0 * report.acceptance_rate
                ))
                .legend(move |(x, y)| {
                    Rectangle::new([(x, y - 5), (x + 10, y + 5)], colour.filled())
                });
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()
            .map_err(|e| plot_error(&e))?;
        root.present().map_err(|e| plot_error(&e))?;
    }
    Ok(svg)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(per_position: Vec<f64>, tau: f64) -> AcceptanceReport {
        let json = serde_json::json!({
            "prompts": 37, "k": per_position.len(), "temperature": 0.0,
            "acceptance_rate": 0.25, "mean_accepted_length": tau - 1.0,
            "mean_accepted_length_with_bonus": tau,
            "per_position_acceptance": per_position,
            "alpha": 0.3, "top1_agreement": 0.3, "expected_length_from_alpha": 1.4,
            "tokens": 100, "speculative_seconds": 1.0, "speculative_tokens_per_second": 100.0,
            "target_seconds": null, "target_tokens_per_second": null,
            "draft_tokens_per_second": null, "measured_speedup": null, "cost_ratio": null,
            "theoretical_speedup": null, "greedy_identical_rows": null,
            "stats": crate::SpecStats::default()
        });
        serde_json::from_value(json).unwrap()
    }

    /// The bars' heights in pixels, in drawing order (filled rectangles other than the
    /// background and the legend's swatches and box).
    fn bar_heights(svg: &str, colour: &str) -> Vec<f64> {
        svg.split("<rect")
            .skip(1)
            .filter(|r| r.contains(&format!("fill=\"{colour}\"")))
            .map(|r| {
                let attr = |name: &str| -> f64 {
                    let at = r.find(&format!(" {name}=\"")).unwrap() + name.len() + 3;
                    r[at..].split('"').next().unwrap().parse().unwrap()
                };
                attr("height")
            })
            .collect()
    }

    #[test]
    fn bars_are_as_tall_as_their_acceptance_and_the_legend_names_each_report() {
        let before = report(vec![0.1, 0.2, 0.0, 0.4], 1.12);
        let after = report(vec![0.3, 0.6, 0.5, 0.8], 1.47);
        let svg = acceptance_svg(&[("before", &before), ("after", &after)]).unwrap();
        assert!(svg.starts_with("<svg"), "{}", &svg[..40]);
        assert!(svg.contains("before: τ 1.12, acceptance 25.0%"));
        assert!(svg.contains("after: τ 1.47, acceptance 25.0%"));
        assert!(svg.contains("Acceptance per drafted position (37 prompts, k = 4, greedy)"));
        // One bar per position per report (plus one legend swatch each), in proportion.
        let (b, a) = (bar_heights(&svg, "#E69F00"), bar_heights(&svg, "#0072B2"));
        assert_eq!((b.len(), a.len()), (5, 5), "{svg}");
        let unit = a[0] / 0.3;
        for (h, want) in a[..4].iter().zip([0.3, 0.6, 0.5, 0.8]) {
            assert!((h - want * unit).abs() <= 1.0, "{a:?}");
        }
        for (h, want) in b[..4].iter().zip([0.1, 0.2, 0.0, 0.4]) {
            assert!((h - want * unit).abs() <= 1.0, "{b:?}");
        }
        assert!(acceptance_svg(&[]).is_err());
    }
}
