# Installation. `cmake --install`: the header, the shared library, a CMake package
# (find_package(msaidx) -> msaidx::msaidx) and a pkg-config file. The Python wheel (scikit-build-core
# sets SKBUILD) takes the shared library alone, inside the package next to its loader.
if(SKBUILD)
  install(FILES $<TARGET_FILE:msaidx> DESTINATION msaidx RENAME libmsaidx.so)
  return()
endif()

include(CMakePackageConfigHelpers)
set_target_properties(msaidx PROPERTIES PUBLIC_HEADER
                      "${CMAKE_CURRENT_SOURCE_DIR}/include/msaidx.h;${MSAIDX_GENERATED_INCLUDE}/msaidx_version.h")
install(TARGETS msaidx EXPORT msaidxTargets
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        PUBLIC_HEADER DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
set(MSAIDX_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/msaidx)
install(EXPORT msaidxTargets NAMESPACE msaidx:: DESTINATION ${MSAIDX_CMAKE_DIR})
configure_package_config_file(${CMAKE_CURRENT_SOURCE_DIR}/cmake/msaidxConfig.cmake.in
                              ${CMAKE_CURRENT_BINARY_DIR}/msaidxConfig.cmake
                              INSTALL_DESTINATION ${MSAIDX_CMAKE_DIR})
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/msaidxConfigVersion.cmake
                                 COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/msaidxConfig.cmake
              ${CMAKE_CURRENT_BINARY_DIR}/msaidxConfigVersion.cmake
        DESTINATION ${MSAIDX_CMAKE_DIR})
# Relative to the .pc file, so that `cmake --install --prefix` anywhere gives a working file.
file(RELATIVE_PATH MSAIDX_PC_TO_PREFIX /root/${CMAKE_INSTALL_LIBDIR}/pkgconfig /root)
configure_file(${CMAKE_CURRENT_SOURCE_DIR}/cmake/msaidx.pc.in ${CMAKE_CURRENT_BINARY_DIR}/msaidx.pc @ONLY)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/msaidx.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
# Apache-2.0 section 4(a): the license travels with every copy.
install(FILES ${CMAKE_CURRENT_SOURCE_DIR}/LICENSE DESTINATION ${CMAKE_INSTALL_DOCDIR})
