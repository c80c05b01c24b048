//! Pixel-exact geometry on hand-made scenes, and scene validation.

mod support;

use support::{inside_f64, inside_with_boundary, object};
use vl_shapes::{render, sample_object, scene_rng, Colour, Object, Scene, SceneError, Shape, Size};

/// Filled pixels of a one-object scene, as a 64 × 64 grid.
fn mask(object: Object) -> Vec<Vec<bool>> {
    let scene = Scene::new(0, vec![object]).expect("valid hand-made scene");
    let image = render(&scene);
    (0..64)
        .map(|py| {
            (0..64)
                .map(|px| image.get_pixel(px, py).0 != [0; 3])
                .collect()
        })
        .collect()
}

fn count(mask: &[Vec<bool>]) -> usize {
    mask.iter().flatten().filter(|&&on| on).count()
}

fn row_columns(mask: &[Vec<bool>], row: usize) -> Vec<usize> {
    (0..64).filter(|&col| mask[row][col]).collect()
}

#[test]
fn small_square_fills_its_box_exactly() {
    let square = mask(object(Shape::Square, Size::Small, Colour::Red, 10, 2, 2));
    assert_eq!(count(&square), 100);
    for (row, cells) in square.iter().enumerate() {
        for (col, &on) in cells.iter().enumerate() {
            assert_eq!(on, (2..12).contains(&row) && (2..12).contains(&col));
        }
    }
}

#[test]
fn circles_are_symmetric_and_touch_their_box() {
    for s in [10, 11, 14, 20, 25, 26] {
        let (x, y) = (20, 17);
        let disk = mask(object(
            Shape::Circle,
            if s <= 14 { Size::Small } else { Size::Large },
            Colour::Blue,
            s,
            x,
            y,
        ));
        let inside = |row: usize, col: usize| disk[y as usize + row][x as usize + col];
        let n = s as usize;
        for row in 0..n {
            for col in 0..n {
                assert_eq!(inside(row, col), inside(row, n - 1 - col), "s={s}");
                assert_eq!(inside(row, col), inside(n - 1 - row, col), "s={s}");
                assert_eq!(inside(row, col), inside(col, row), "s={s}");
            }
        }
        // Nothing outside the box; the middle row spans it; corners empty.
        let total = count(&disk);
        let boxed = (0..n)
            .flat_map(|row| (0..n).map(move |col| (row, col)))
            .filter(|&(row, col)| inside(row, col))
            .count();
        assert_eq!(total, boxed);
        assert!((0..n).all(|col| inside(n / 2, col)), "s={s}");
        assert!(!inside(0, 0), "s={s}");
        let area = std::f64::consts::PI * (s * s) as f64 / 4.0;
        assert!((total as f64 - area).abs() < 2.0 * s as f64, "s={s}");
    }
}

#[test]
fn small_circle_of_side_ten_has_the_known_rows() {
    // Disk of radius 5 at (25, 25): row widths read off the inequality.
    let disk = mask(object(
        Shape::Circle,
        Size::Small,
        Colour::Green,
        10,
        20,
        20,
    ));
    let widths: Vec<usize> = (20..30).map(|row| row_columns(&disk, row).len()).collect();
    assert_eq!(widths, [4, 8, 8, 10, 10, 10, 10, 8, 8, 4]);
    assert_eq!(count(&disk), 80);
}

#[test]
fn triangle_apex_and_base_rows() {
    // Even side: the apex falls between two pixel centres, so the first
    // row is empty and the second has the two middle pixels.
    let even = mask(object(
        Shape::Triangle,
        Size::Small,
        Colour::Yellow,
        10,
        20,
        20,
    ));
    assert!(row_columns(&even, 20).is_empty());
    assert_eq!(row_columns(&even, 21), [24, 25]);
    assert_eq!(row_columns(&even, 29), (20..30).collect::<Vec<_>>());
    assert!(row_columns(&even, 30).is_empty());
    // Odd side: the apex pixel is the middle one of the first row.
    let odd = mask(object(
        Shape::Triangle,
        Size::Small,
        Colour::Yellow,
        11,
        20,
        20,
    ));
    assert_eq!(row_columns(&odd, 20), [25]);
    assert_eq!(row_columns(&odd, 30), (20..31).collect::<Vec<_>>());
    for (triangle, s) in [(&even, 10), (&odd, 11)] {
        let widths: Vec<usize> = (20..20 + s)
            .map(|row| row_columns(triangle, row).len())
            .collect();
        assert!(
            widths.windows(2).all(|pair| pair[0] <= pair[1]),
            "{widths:?}"
        );
        for row in 20..20 + s {
            let cols = row_columns(triangle, row);
            if let (Some(first), Some(last)) = (cols.first(), cols.last()) {
                // Left-right symmetric about the box's middle.
                assert_eq!(first + last, 2 * 20 + s - 1, "row {row}: {cols:?}");
                assert_eq!(cols.len(), last - first + 1, "row {row}: {cols:?}");
            }
        }
    }
}

#[test]
fn exact_geometry_matches_a_float_reading_of_the_page() {
    let mut rng = scene_rng(11, 0);
    for _ in 0..3000 {
        let object = sample_object(&mut rng);
        for py in object.y.saturating_sub(1)..object.y + object.s + 1 {
            for px in object.x.saturating_sub(1)..object.x + object.s + 1 {
                assert_eq!(object.contains_pixel(px, py), inside_f64(&object, px, py));
            }
        }
    }
}

#[test]
fn scene_validation_names_the_broken_rule() {
    let red_circle = object(Shape::Circle, Size::Small, Colour::Red, 10, 2, 2);
    let blue_square = object(Shape::Square, Size::Large, Colour::Blue, 20, 40, 2);
    assert!(Scene::new(40, vec![red_circle, blue_square]).is_ok());
    assert_eq!(
        Scene::new(41, vec![red_circle]),
        Err(SceneError::Background { grey: 41 })
    );
    assert_eq!(
        Scene::new(0, vec![]),
        Err(SceneError::ObjectCount { count: 0 })
    );
    assert!(matches!(
        Scene::new(0, vec![red_circle; 3]),
        Err(SceneError::ObjectCount { count: 3 })
    ));
    let too_big = Object {
        s: 15,
        ..red_circle
    };
    assert!(matches!(
        Scene::new(0, vec![too_big]),
        Err(SceneError::Side { side: 15, .. })
    ));
    let off_edge = Object {
        x: 53,
        ..red_circle
    };
    assert!(matches!(
        Scene::new(0, vec![off_edge]),
        Err(SceneError::Placement { axis: 'x', .. })
    ));
    assert!(Scene::new(
        0,
        vec![Object {
            x: 52,
            ..red_circle
        }]
    )
    .is_ok());
    let near_edge = Object { y: 1, ..red_circle };
    assert!(matches!(
        Scene::new(0, vec![near_edge]),
        Err(SceneError::Placement { axis: 'y', .. })
    ));
    let off_colour = Object {
        rgb: [241, 40, 40],
        ..red_circle
    };
    assert!(matches!(
        Scene::new(0, vec![off_colour]),
        Err(SceneError::Rgb { .. })
    ));
    // Grown boxes may touch (gap of 4 pixels) but not overlap (gap of 3).
    let touching = Object {
        x: 16,
        ..blue_square
    };
    assert!(Scene::new(0, vec![red_circle, touching]).is_ok());
    let overlapping = Object {
        x: 15,
        ..blue_square
    };
    assert_eq!(
        Scene::new(0, vec![red_circle, overlapping]),
        Err(SceneError::Overlap)
    );
    let twin = object(Shape::Circle, Size::Large, Colour::Red, 20, 40, 2);
    assert!(matches!(
        Scene::new(0, vec![red_circle, twin]),
        Err(SceneError::SameColourAndShape { .. })
    ));
    // Centres (7, 7) and (36, 31): dx = 29, dy = 24, | |dx| - |dy| | = 5.
    let diagonal = Object {
        x: 26,
        y: 21,
        ..blue_square
    };
    assert!(matches!(
        Scene::new(0, vec![red_circle, diagonal]),
        Err(SceneError::AmbiguousRelation { .. })
    ));
    let just_off_diagonal = Object {
        x: 27,
        y: 21,
        ..blue_square
    };
    assert!(Scene::new(0, vec![red_circle, just_off_diagonal]).is_ok());
}

/// No pixel centre ever lies exactly on a shape's boundary (box edges are
/// integers and centres half-integers; circle and triangle edges miss them
/// by parity), so renderers that count the boundary in or out agree.
#[test]
fn boundary_convention_never_matters() {
    for shape in Shape::ALL {
        for s in 1..=40 {
            let probe = object(shape, Size::Large, Colour::White, s, 3, 3);
            for py in 0..s + 6 {
                for px in 0..s + 6 {
                    assert_eq!(
                        inside_with_boundary(&probe, px, py, true),
                        inside_with_boundary(&probe, px, py, false),
                        "{shape:?} s={s} pixel ({px}, {py})"
                    );
                }
            }
        }
    }
}
