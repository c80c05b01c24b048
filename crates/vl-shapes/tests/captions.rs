//! Caption writing, strict parsing and scoring.

mod support;

use proptest::prelude::*;
use support::object;
use vl_shapes::{
    caption, dataset_scene, parse_caption, scene_accuracy, score, Colour, ObjectKey, ParseError,
    Relation, Scene, SceneKey, Shape, Size,
};

fn key(size: Size, colour: Colour, shape: Shape) -> ObjectKey {
    ObjectKey {
        size,
        colour,
        shape,
    }
}

/// Two hand-made scenes: a horizontal pair listed right object first, and
/// a vertical pair listed lower object first.
fn horizontal_scene() -> Scene {
    let square = object(Shape::Square, Size::Large, Colour::Blue, 20, 40, 10);
    let circle = object(Shape::Circle, Size::Small, Colour::Red, 10, 4, 12);
    Scene::new(20, vec![square, circle]).expect("valid scene")
}

fn vertical_scene() -> Scene {
    let square = object(Shape::Square, Size::Small, Colour::Green, 12, 26, 46);
    let triangle = object(Shape::Triangle, Size::Large, Colour::White, 24, 20, 4);
    Scene::new(5, vec![square, triangle]).expect("valid scene")
}

#[test]
fn captions_of_the_page_examples() {
    let single = Scene::new(
        0,
        vec![object(Shape::Circle, Size::Small, Colour::Red, 12, 30, 30)],
    )
    .expect("valid scene");
    assert_eq!(caption(&single), "a small red circle");
    assert_eq!(
        caption(&horizontal_scene()),
        "a small red circle to the left of a large blue square"
    );
    assert_eq!(
        caption(&vertical_scene()),
        "a large white triangle above a small green square"
    );
}

#[test]
fn caption_parses_back_to_the_key_for_many_seeds() {
    for index in 0..2000 {
        let scene = dataset_scene(42, index);
        let text = caption(&scene);
        assert_eq!(parse_caption(&text), Ok(scene.key()), "{text}");
        assert!(score(&text, &scene));
    }
}

#[test]
fn reverse_phrasings_read_as_the_canonical_relation() {
    let circle = key(Size::Small, Colour::Red, Shape::Circle);
    let square = key(Size::Large, Colour::Blue, Shape::Square);
    let left = SceneKey::Two {
        first: circle,
        relation: Relation::LeftOf,
        second: square,
    };
    assert_eq!(
        parse_caption("a large blue square to the right of a small red circle"),
        Ok(left)
    );
    let triangle = key(Size::Large, Colour::White, Shape::Triangle);
    let green = key(Size::Small, Colour::Green, Shape::Square);
    let above = SceneKey::Two {
        first: triangle,
        relation: Relation::Above,
        second: green,
    };
    assert_eq!(
        parse_caption("a small green square below a large white triangle"),
        Ok(above)
    );

    let horizontal = horizontal_scene();
    assert!(score(
        "a large blue square to the right of a small red circle",
        &horizontal
    ));
    assert!(!score(
        "a large blue square to the left of a small red circle",
        &horizontal
    ));
    assert!(!score(
        "a small red circle above a large blue square",
        &horizontal
    ));
    assert!(!score("a small red circle", &horizontal));
    let vertical = vertical_scene();
    assert!(score(
        "a small green square below a large white triangle",
        &vertical
    ));
    assert!(!score(
        "a small green square above a large white triangle",
        &vertical
    ));
    assert!(!score(
        "a small green square below a small white triangle",
        &vertical
    ));
}

#[test]
fn malformed_captions_are_errors() {
    let bad = [
        "",
        " a small red circle",
        "a small red circle ",
        "a  small red circle",
        "a small red circle.",
        "a small red circle,",
        "A small red circle",
        "a Small red circle",
        "a small grey circle",
        "a small red circles",
        "an small red circle",
        "a red small circle",
        "a small red circle\n",
        "a\tsmall red circle",
        "a small red",
        "small red circle",
        "a small red circle and",
        "a small red circle to the left",
        "a small red circle to the left of",
        "a small red circle to left of a large blue square",
        "a small red circle to the left a large blue square",
        "a small red circle on the left of a large blue square",
        "a small red circle to the left of a large blue square now",
        "a small red circle to the left of a large blue square.",
        "a small red circle above a large blue square above a small green circle",
    ];
    for text in bad {
        assert!(parse_caption(text).is_err(), "{text:?} parsed");
    }
    assert_eq!(parse_caption(""), Err(ParseError::Empty));
    assert_eq!(
        parse_caption("a small red circle "),
        Err(ParseError::EmptyWord { position: 5 })
    );
    assert!(matches!(
        parse_caption("A small red circle"),
        Err(ParseError::UnexpectedWord { position: 1, ref word, .. }) if word == "A"
    ));
    assert!(matches!(
        parse_caption("a small red circle."),
        Err(ParseError::UnexpectedWord { position: 4, ref word, .. }) if word == "circle."
    ));
    assert!(matches!(
        parse_caption("a small red circle above a large blue square now"),
        Err(ParseError::TrailingWords { position: 10, ref word }) if word == "now"
    ));
    let message = parse_caption("a small grey circle")
        .expect_err("grey is not a colour")
        .to_string();
    assert!(
        message.contains("grey") && message.contains('3'),
        "{message}"
    );
}

#[test]
fn accuracy_is_the_share_of_correct_predictions() {
    let horizontal = horizontal_scene();
    let vertical = vertical_scene();
    let pairs = [
        (
            "a small red circle to the left of a large blue square",
            &horizontal,
        ),
        (
            "a large blue square to the right of a small red circle",
            &horizontal,
        ),
        (
            "a small red circle to the left of a large blue square",
            &vertical,
        ),
        (
            "a large white triangle above a small green square.",
            &vertical,
        ),
    ];
    assert_eq!(scene_accuracy(pairs), 0.5);
    let owned: Vec<(String, Scene)> = vec![(vertical.caption(), vertical.clone())];
    assert_eq!(scene_accuracy(owned), 1.0);
    assert_eq!(scene_accuracy(Vec::<(&str, &Scene)>::new()), 0.0);
}

fn object_key() -> impl Strategy<Value = ObjectKey> {
    (
        prop::sample::select(Size::ALL.to_vec()),
        prop::sample::select(Colour::ALL.to_vec()),
        prop::sample::select(Shape::ALL.to_vec()),
    )
        .prop_map(|(size, colour, shape)| key(size, colour, shape))
}

fn scene_key() -> impl Strategy<Value = SceneKey> {
    prop_oneof![
        object_key().prop_map(SceneKey::One),
        (
            object_key(),
            prop::sample::select(vec![Relation::LeftOf, Relation::Above]),
            object_key()
        )
            .prop_map(|(first, relation, second)| SceneKey::Two {
                first,
                relation,
                second
            }),
    ]
}

proptest! {
    #[test]
    fn parse_inverts_caption(key in scene_key()) {
        prop_assert_eq!(parse_caption(&key.to_string()), Ok(key));
    }

    #[test]
    fn reversed_phrasing_parses_to_the_same_key(key in scene_key()) {
        if let SceneKey::Two { first, relation, second } = key {
            let reverse = match relation {
                Relation::LeftOf => "to the right of",
                Relation::Above => "below",
            };
            let text = format!("{second} {reverse} {first}");
            prop_assert_eq!(parse_caption(&text), Ok(key));
        }
    }

    #[test]
    fn sampled_scenes_round_trip(seed in any::<u64>(), index in any::<u64>()) {
        let scene = dataset_scene(seed, index);
        prop_assert_eq!(parse_caption(&caption(&scene)), Ok(scene.key()));
    }

    #[test]
    fn inserting_a_foreign_character_breaks_the_caption(
        key in scene_key(),
        at in any::<prop::sample::Index>(),
        foreign in prop::sample::select(vec!['.', ',', '!', 'A', 'Z', '\n', '\t', '-', '1', 'é']),
    ) {
        let mut text = key.to_string();
        let boundaries: Vec<usize> = (0..=text.len()).filter(|&i| text.is_char_boundary(i)).collect();
        text.insert(boundaries[at.index(boundaries.len())], foreign);
        prop_assert!(parse_caption(&text).is_err(), "{:?} parsed", text);
    }

    #[test]
    fn doubling_a_space_breaks_the_caption(key in scene_key(), at in any::<prop::sample::Index>()) {
        let text = key.to_string();
        let spaces: Vec<usize> = text.match_indices(' ').map(|(i, _)| i).collect();
        let mut broken = text.clone();
        broken.insert(spaces[at.index(spaces.len())], ' ');
        prop_assert_eq!(
            parse_caption(&broken).err().map(|e| matches!(e, ParseError::EmptyWord { .. })),
            Some(true)
        );
    }
}
