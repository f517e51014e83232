use super::*;

#[test]
fn device_mapping_expressions() {
    assert_eq!(
        parse_device_mapping("list(range(0,8))").unwrap(),
        (0..8).collect::<Vec<_>>()
    );
    assert_eq!(
        parse_device_mapping("list(range(4, 8))").unwrap(),
        vec![4, 5, 6, 7]
    );
    assert_eq!(
        parse_device_mapping("list(range(0,8,2))").unwrap(),
        vec![0, 2, 4, 6]
    );
    assert_eq!(parse_device_mapping("[0, 1,2]").unwrap(), vec![0, 1, 2]);
    assert_eq!(parse_device_mapping("3").unwrap(), vec![3]);
    assert!(
        parse_device_mapping("list(range(a,8))")
            .unwrap_err()
            .contains("`a`")
    );
    let m: DeviceMapping = serde_yaml::from_str("[0, 1]").unwrap();
    assert_eq!(m.0, vec![0, 1]);
    let m: DeviceMapping = serde_yaml::from_str("list(range(0,2))").unwrap();
    assert_eq!(m.0, vec![0, 1]);
}

#[test]
fn resume_and_lora_target_forms() {
    let r: ResumeFrom = serde_yaml::from_str("false").unwrap();
    assert_eq!(r, ResumeFrom::No);
    let r: ResumeFrom = serde_yaml::from_str("true").unwrap();
    assert_eq!(r, ResumeFrom::Latest);
    let r: ResumeFrom = serde_yaml::from_str("out/checkpoint-10").unwrap();
    assert_eq!(r, ResumeFrom::Path("out/checkpoint-10".into()));
    let t: LoraTarget = serde_yaml::from_str("q_proj, v_proj").unwrap();
    assert_eq!(t.modules(), vec!["q_proj", "v_proj"]);
    let t: LoraTarget = serde_yaml::from_str("all-linear").unwrap();
    assert_eq!(t.modules().len(), 7);
}
