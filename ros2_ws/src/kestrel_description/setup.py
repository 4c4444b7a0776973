from glob import glob

from setuptools import find_packages, setup

package_name = 'kestrel_description'

setup(
    name=package_name,
    version='0.1.0',
    packages=find_packages(exclude=['test']),
    data_files=[
        ('share/ament_index/resource_index/packages', ['resource/' + package_name]),
        ('share/' + package_name, ['package.xml']),
        # the ROS convention: share/<pkg>/urdf/<robot>.urdf (robot_description)
        ('share/' + package_name + '/urdf', glob(package_name + '/urdf/*.urdf')),
    ],
    package_data={package_name: ['urdf/*.urdf']},
    include_package_data=True,
    install_requires=['setuptools'],
    zip_safe=True,
    maintainer='Kestrel developers',
    maintainer_email='dev@kestrel.invalid',
    description='Kestrel robot description (URDF of the arm and gripper).',
    license='Apache-2.0',
)
