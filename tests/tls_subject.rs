//! A client certificate's subject reads as `openssl x509 -noout -subject -nameopt RFC2253`
//! prints it (the form `[[auth.certificates]] subject` is written in), for certificates made by
//! openssl itself: several RDNs, a multi-valued RDN, and values that need escaping.

use std::path::Path;
use std::process::Command;

use powerhub::security::tls::PeerSubject;

fn openssl(dir: &Path, args: &[&str]) -> Vec<u8> {
    let out = Command::new("openssl")
        .current_dir(dir)
        .args(args)
        .output()
        .expect("openssl runs (scripts/install-test-deps.sh installs it)");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

#[test]
fn a_certificates_subject_reads_as_openssl_prints_it_in_rfc2253() {
    let dir = std::env::temp_dir().join(format!("powerhub-subject-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let subjects = [
        "/CN=alice",
        "/O=Example/OU=Sensors/CN=sensor-7",
        "/O=Example+CN=sensor-7",
        "/C=DE/O=Example/CN=a+UID=b+OU=c",
        "/O=Example, Inc./CN=comma\\,plus+equals=",
    ];
    for subject in subjects {
        openssl(
            &dir,
            &[
                "req",
                "-x509",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:P-256",
                "-nodes",
                "-days",
                "1",
                "-multivalue-rdn",
                "-subj",
                subject,
                "-keyout",
                "key.pem",
                "-out",
                "cert.pem",
            ],
        );
        let printed = openssl(
            &dir,
            &[
                "x509", "-in", "cert.pem", "-noout", "-subject", "-nameopt", "RFC2253",
            ],
        );
        let printed = String::from_utf8(printed).unwrap();
        let printed = printed.trim().strip_prefix("subject=").unwrap();
        let der = openssl(&dir, &["x509", "-in", "cert.pem", "-outform", "DER"]);
        let read = PeerSubject::from_certificate(&der).unwrap();
        assert_eq!(read.distinguished_name, printed, "{subject}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
